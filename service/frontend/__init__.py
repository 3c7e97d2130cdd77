"""The front end: the FastAPI app, the HTTP server, inputs, routers, the Open Inference Protocol over HTTP and gRPC. Holds no model state."""
