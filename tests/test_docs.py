"""The documents: the configuration page is the help text, links resolve, the README keeps CI's contract."""
import re
from pathlib import Path

from experiments import docs_config

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_configuration_page_is_the_help_text():
    committed = docs_config.PAGE.read_text()
    assert committed == docs_config.render(), \
        "docs/configuration.md differs from `pdlab run --help`: run `python -m experiments.docs_config`"


def test_help_text_stops_before_hydras_flags():
    text = docs_config.help_text()
    assert "== Top-level keys ==" in text and "scheduler.token_budget" in text
    assert docs_config.FLAGS_START not in text and str(ROOT) not in text


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_relative_links_in_readme_and_docs_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue   # a URL or an anchor in the same page
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_readme_keeps_what_ci_runs_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m ")]
    assert ci, ".ci/run runs no python3 -m command"
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", readme, flags=re.S))
    for command in ci:
        assert re.search(rf"^{re.escape(command)}(\s|$)", blocks, flags=re.M), f"README lacks `{command}`"
    assert re.search(r"^pdlab run\b", blocks, flags=re.M), "README's main job is not `pdlab run`"
    assert len(readme.splitlines()) <= 260, f"README.md has {len(readme.splitlines())} lines (at most ~250)"


def test_every_pdlab_command_in_the_documents_exists():
    """`pdlab X` in code spans and code blocks names a real subcommand (or benchmark)."""
    from experiments import cli
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown, checked = [], 0
    for page in pages:
        text = page.read_text()
        code = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S))
        found = re.findall(r"`pdlab (bench )?([a-z][a-z-]+)", text) + \
            re.findall(r"^\$? ?pdlab (bench )?([a-z][a-z-]+)", code, flags=re.M)
        checked += len(found)
        for bench, name in found:
            known = cli.BENCHES if bench else cli.COMMANDS
            if name not in known and not (not bench and name == "bench"):
                unknown.append(f"{page.relative_to(ROOT)}: pdlab {bench}{name}")
    assert checked > 10, f"only {checked} pdlab commands found: is the pattern still right?"
    assert not unknown, "no such subcommand:\n" + "\n".join(sorted(set(unknown)))
