"""
README.md and docs/: the README stays short enough to read in one sitting, every relative link in
them leads to a file of this checkout, every `python SCRIPT` they show names a script that is there
(their commands run from the repository root), and the lower-level recipe of docs/library.md runs
as written.
"""
import glob
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DOCS = sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
PAGES = [README, *DOCS]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# `python SCRIPT.py`, `python3 SCRIPT.py` and torchrun's SCRIPT.py after its options
SCRIPT = re.compile(r"(?:\bpython3?|\btorchrun(?:\s+--\S+)*)\s+([\w./-]+\.py)\b")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def relative_links(path):
    """The targets of path's Markdown links that are files of this checkout (no URL, no bare #anchor),
    without their #anchor."""
    links = []
    for target in LINK.findall(read(path)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        links.append(target.split("#", 1)[0])
    return links


def test_there_are_docs_and_the_readme_reads_in_one_sitting():
    assert DOCS, "docs/*.md"
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move a section to docs/"


def test_every_relative_link_names_a_file_that_is_there():
    broken = [f"{os.path.relpath(page, REPO)}: {target}" for page in PAGES for target in relative_links(page)
              if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(page), target)))]
    assert not broken, broken


def test_the_readme_links_every_docs_page():
    linked = {os.path.normpath(os.path.join(REPO, target)) for target in relative_links(README)}
    assert not [page for page in DOCS if page not in linked]


def test_every_script_a_command_runs_is_there():
    named = {(os.path.relpath(page, REPO), script) for page in PAGES for script in SCRIPT.findall(read(page))}
    assert any(script == "train.py" for _, script in named)  # the pattern finds what it is for
    missing = [f"{page}: {script}" for page, script in sorted(named) if not os.path.isfile(os.path.join(REPO, script))]
    assert not missing, missing


def test_the_pattern_finds_scripts_after_python_and_torchrun():
    text = ("    python bench/throughput.py --quick\n    torchrun --standalone --nproc_per_node=8 train.py cfg.py\n"
            "run `python gns-analysis.py OUT`; not `python -c 'x.py'`")
    assert SCRIPT.findall(text) == ["bench/throughput.py", "train.py", "gns-analysis.py"]


def python_block(path, heading):
    """The first ```python block after heading in path."""
    text = read(path)
    section = text[text.index(heading):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("\n```\n", start)]


def test_the_estimators_by_hand_recipe_runs_as_written(tmp_path):
    code = python_block(os.path.join(REPO, "docs", "library.md"), "## The estimators by hand")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.splitlines() if line[:1].isdigit()]
    assert [line[0] for line in lines] == ["0", "1", "2"], run.stdout
    assert all(line[1] == "gns" and line[-1] == "columns" for line in lines), run.stdout
