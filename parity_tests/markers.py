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


def row_key(row: str) -> str:
    """A markdown table row's name: the first word of its first cell ("| llama (llama -> hf-llama) |
    ..." -> "llama")."""
    return row.split("|")[1].strip().split(" ")[0]


def replace_rows(path: str, rows: str, start: str, end: str, name: str) -> None:
    """Replace, in the table between the markers of the file at `path`, the rows named as the
    rows of `rows` (`row_key`), each in its place; the other rows stay as they are. A ValueError
    names a row the table does not hold (a new one needs the whole table written)."""
    with open(path) as f:
        doc = f.read()
    if start not in doc or end not in doc:
        splice(doc, "", start, end, name)  # raises, naming the markers
    table = doc.split(start, 1)[1].split(end, 1)[0].strip("\n").splitlines()
    new = {row_key(r): r for r in rows.strip("\n").splitlines() if r.startswith("| ")}
    keys = [row_key(r) if r.startswith("| ") and not r.startswith("|---") else None for r in table]
    missing = sorted(set(new) - set(keys))
    if missing:
        raise ValueError(f"the {name} table of {path} has no rows {missing}: write the whole table (without --only)")
    text = "\n".join(new.get(k, r) if k else r for k, r in zip(keys, table, strict=True)) + "\n"
    with open(path, "w") as f:
        f.write(splice(doc, text, start, end, name))
