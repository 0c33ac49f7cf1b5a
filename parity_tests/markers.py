"""Generated tables kept between two marker lines of a markdown page (docs/parity.md,
docs/families.md): one splice for every writer."""

from __future__ import annotations


def splice(document: str, text: str, start: str, end: str, name: str) -> str:
    """`document` with the text between the `start` and `end` marker lines replaced by `text`;
    a ValueError naming the `name` markers and showing both lines if either is missing."""
    if start not in document or end not in document:
        raise ValueError(f"the document has no {name} markers; add these two lines where the table goes:\n"
                         f"{start}\n{end}")
    head, rest = document.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{text}{end}{tail}"


def rewrite(path: str, text: str, start: str, end: str, name: str) -> None:
    """Replace the table between the markers of the file at `path` by `text`."""
    with open(path) as f:
        doc = f.read()
    with open(path, "w") as f:
        f.write(splice(doc, text, start, end, name))
