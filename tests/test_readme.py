"""README.md as a new user reads it: the env snippet runs as written on a CPU, every registered env id is listed,
CI runs the README's set-up commands, the package metadata exposes what those commands promise, every checkpoint
and page it names is in the repository, and it speaks only of the software."""

import re
from pathlib import Path

import pytest
import torch

import envs

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def code_blocks(language):
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def test_env_snippet_runs_as_written_on_cpu(monkeypatch, capsys):
    snippet = next(block for block in code_blocks("python") if "gym.make_vec" in block)
    assert '"cuda"' not in snippet.replace('"cuda" if torch.cuda.is_available() else "cpu"', "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["device"] == "cpu" and namespace["reward"].device.type == "cpu"
    assert namespace["obs"]["observation"].shape == (1024, 36)
    printed = capsys.readouterr().out
    assert len(printed.splitlines()) == 6  # the 6x6 grid of render_text


def test_every_registered_env_id_is_listed():
    section = README[README.index("## Environments"):]
    section = section[:section.index("\n## ", 1)]
    listed = set(re.findall(r"`((?:BoxPick|LightsOut)-[\w-]+-v0)`", section))
    assert listed == set(envs.ENV_IDS)
    assert "BoxPick-Generalize-1-1-v0`, a small debugging env" in section


def test_ci_runs_the_readme_set_up_commands():
    install, test = code_blocks("bash")[0].splitlines()[:2]
    assert install.startswith("python3 -m venv .venv") and install.endswith("pip install -r requirements.txt -e .")
    assert test == "python -m pytest tests -q"
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci.index(install) < ci.index(test)


def test_pyproject_installs_the_envs_package_and_every_script():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert setuptools["packages"] == ["envs"]
    scripts = {p.stem for p in REPO.glob("*.py")}
    assert set(setuptools["py-modules"]) == scripts
    # requirements.txt keeps the tested torch pinned: an open range would pull a multi-GB CUDA build
    assert re.search(r"^torch==\d", (REPO / "requirements.txt").read_text(), flags=re.M)


def test_every_checkpoint_the_readme_names_is_in_the_repository():
    """The README's commands (the CPU evaluations among them) name committed checkpoints under checkpoints/: a
    renamed or dropped folder would break them. Paths with a placeholder (S, <time>, *) stand for several runs."""
    named = set(re.findall(r"checkpoints/[\w.\-/]+\.pt", README))
    concrete = {path for path in named if "__S__" not in path}
    assert {"checkpoints/BoxPick-Generalize-4-1-v0__cont280k-lambda0__1__1795738217/final.pt",
            "checkpoints/BoxPick-Generalize-4-1-v0__cont280k-lambda1__1__1795737978/final.pt",
            "checkpoints/BoxPick-Generalize-4-1-v0__gen-flax__1__1795708977/pretrained.pt",
            "checkpoints/BoxPick-Generalize-4-1-v0__gen-flax__1__1795708977/final.pt"} <= concrete
    missing = sorted(path for path in concrete if not (REPO / path).is_file())
    assert not missing, f"README names checkpoints that are not in the repository: {missing}"
    assert "carry/" not in README


def test_every_page_the_readme_links_is_in_the_repository():
    links = set(re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README))
    local = {link for link in links if "://" not in link}
    assert "docs/results/boxpick.md" in local and "checkpoints/README.md" in local
    missing = sorted(link for link in local if not (REPO / link).exists())
    assert not missing, f"README links to files that are not in the repository: {missing}"


def test_readme_is_short_and_depends_on_nothing_outside_the_repository():
    assert len(README.splitlines()) <= 300
    assert "../shared" not in README and "REFERENCE.md" not in README
    # the README speaks of the software, not of how the work on it was organised
    words = "|".join(["sess" + "ion", "lea" + "se", "len" + "t "])  # spelt in pieces, so this file stays clean too
    assert not re.search(words, README, flags=re.I)


DOCS = [REPO / "checkpoints/README.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", DOCS, ids=lambda page: str(page.relative_to(REPO)))
def test_every_docs_page_links_only_to_files_in_the_repository(page):
    text = page.read_text()
    links = {link for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in link}
    missing = sorted(link for link in links if not (page.parent / link).exists())
    assert not missing, f"{page.relative_to(REPO)} links to files that are not in the repository: {missing}"
    assert "../shared" not in text and "carry/" not in text
    words = "|".join(["sess" + "ion", "lea" + "se", "len" + "t "])
    assert not re.search(words, text, flags=re.I), page


def test_figures_are_small():
    sizes = {path.name: path.stat().st_size for path in (REPO / "docs/figures").glob("*")}
    assert sizes and max(sizes.values()) <= 200_000, sizes
