"""A checkpoint's labels against the service's reader of labels.txt: every label the importer
accepts is written to labels.txt and read back by ``service.contract.model_repository.read_labels``
(what the service loads a version with) as itself, and unique."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from export.checkpoint import CheckpointError
from export.importers.labels import unique_labels
from export.repository import RepositoryError, write_version
from service.contract.model_repository import labels_text, read_labels

# Line breaks str.splitlines knows beyond "\n" and "\r", and whitespace str.strip drops.
AWKWARD = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029 \t\u3000"


def written_and_read(labels: list[str]) -> list[str]:
    """The labels through the importer, labels.txt and the service's reader."""
    return read_labels(labels_text(unique_labels(labels, "config.json")))


def test_whitespace_around_a_label_is_dropped_as_the_service_reads_it():
    assert unique_labels([" cat", "dog\t", "\u3000bird"], "c") == ["cat", "dog", "bird"]
    assert written_and_read([" cat", "dog\t"]) == ["cat", "dog"]


@pytest.mark.parametrize(
    ("label", "code"), [("a\u2028b", "U+2028"), ("dog\x0bx", "U+000B"), ("e\x85f", "U+0085")]
)
def test_a_line_break_the_service_would_split_at_is_refused_naming_it(label, code):
    labels = [" cat", "bird", label, "fish"]
    with pytest.raises(CheckpointError) as error:
        unique_labels(labels, "config.json")
    assert f"config.json: label 2 {label!r} cannot be served: it holds a line break ({code})" in (
        str(error.value)
    )
    # what the service would have made of labels.txt as it was written before: 5 labels for 4
    assert len(read_labels("\n".join(labels) + "\n")) == 5


def test_a_blank_label_is_refused():
    with pytest.raises(CheckpointError, match="label 1 ' ' cannot be served: it is blank"):
        unique_labels(["cat", " "], "config.json")


def test_repeated_names_are_told_apart_even_from_a_name_that_looks_numbered():
    labels = unique_labels(["a", "a", "a (class 1)"], "c")
    assert labels == ["a (class 0)", "a (class 1, 2)", "a (class 1)"]
    assert written_and_read(["a", "a", "a (class 1)"]) == labels


@given(st.lists(st.text(alphabet=st.sampled_from("ab(1) " + AWKWARD), max_size=6), max_size=12))
def test_every_label_accepted_reads_back_as_itself_and_unique(labels):
    try:
        accepted = unique_labels(labels, "c")
    except CheckpointError:
        # refused only for a label that is blank or that the reader would split
        assert any(len(read_labels(label)) != 1 for label in labels)
        return
    assert len(accepted) == len(labels) == len(set(accepted))
    assert read_labels(labels_text(accepted)) == accepted
    # each as the service reads it, a name that repeats numbered by its class
    names = [read_labels(label)[0] for label in labels]
    for index, (name, label) in enumerate(zip(names, accepted, strict=True)):
        assert (
            label == name if names.count(name) == 1 else label.startswith(f"{name} (class {index}")
        )


@pytest.mark.parametrize("label", [" cat", "a\u2028b", "dog\x0bx", "e\x85f", ""])
def test_the_repository_writes_no_labels_txt_the_service_would_misread(tmp_path, label):
    with pytest.raises(RepositoryError, match=r"cannot be written to labels\.txt"):
        write_version(tmp_path, "m", 1, {}, ["bird", label], (3, 32, 32))
    assert not (tmp_path / "m").exists()
