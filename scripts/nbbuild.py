"""Write a notebook from a list of cells (an authoring aid; the .ipynb files are the source of
truth).

    from scripts.nbbuild import md, code, write_notebook
    write_notebook("notebooks/00_x.ipynb", [md("# Title"), code("x = 1", check=True), code("1/0",
    raises=True)])

``check=True`` adds ``# NBVAL_CHECK_OUTPUT`` (nbval compares the cell's output with the
committed one); ``raises=True`` tags the cell ``raises-exception`` (it is meant to fail).
Execute the notebook afterwards with scripts/execute_notebooks.py.
"""

from __future__ import annotations

import nbformat


def md(text: str):
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(text: str, check: bool = False, raises: bool = False):
    source = text.strip("\n")
    if check:
        source = "# NBVAL_CHECK_OUTPUT\n" + source
    cell = nbformat.v4.new_code_cell(source)
    if raises:
        cell.metadata["tags"] = ["raises-exception"]
    return cell


def write_notebook(path, cells) -> None:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, path)
