"""`make image-test`: the images built from the Dockerfile and run with the compose files, for real.

It builds the CPU service image and the export image with whatever engine answers (Docker when its
daemon does, else podman, driven through its Docker API socket by the pinned Compose CLI), starts
the service with the project's compose files under a project name of its own, and checks what a
user relies on: ready, /predict right on Fashion-MNIST test images, /attention's PNG, gRPC ready,
a read-only root and a non-root user, the healthcheck turning healthy, no onnxruntime warning at
start, a model version exported inside the export image and put into the mounted repository served
without a restart, SIGTERM ending the service with exit 0, `down` leaving nothing behind, and a
plain `docker compose up` on a host without a GPU stopping at once with the line that names the
CPU command. Every failure says which check failed and shows the service's last log lines; the
containers, networks, images and the podman service it started are removed on every way out.
"""
