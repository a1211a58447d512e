"""README.md and docs/*.md hold: every relative link resolves (file and heading anchor), every
command they show exists (make targets, scripts and their options, modules, pip extras), every
docs page is linked from README, README stays a front page, and README's Python blocks run as
pasted, each in a fresh process.

A block README should show but not run (one that needs CUDA) is preceded by a line
`<!-- docs-test: not run (the reason) -->`.
"""

import configparser
import importlib.util
import re
import shlex
import subprocess
import sys
import time

import pytest

from helpers import ROOT, subprocess_env

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [README, *PAGES]

FENCE = re.compile(r"^([ \t]*)(```|~~~)([^\n]*)\n(.*?)^[ \t]*\2[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SHELL = {"", "sh", "bash", "shell", "console"}
NOT_RUN = re.compile(r"<!-- docs-test: not run \((.+?)\) -->\s*$")


def _relative(path):
    return str(path.relative_to(ROOT))


def blocks(path):
    """[(info string, code, the text before the block)] of a markdown file's fenced blocks."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        indent, _, info, body = match.groups()
        code = "".join(line[len(indent) :] if line.startswith(indent) else line
                       for line in body.splitlines(keepends=True))
        found.append((info.strip().lower(), code, text[: match.start()]))
    return found


def prose(text):
    """The text without code: fenced blocks and inline code spans hold no links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped (markdown's too), spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path):
    """Every heading anchor of a markdown file, a repeated one numbered as GitHub numbers it."""
    seen, found = {}, set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path):
    """[(target, anchor or None)] of a markdown file's relative links and images."""
    found = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        found.append((file, anchor or None))
    return found


def broken_links(path):
    broken = []
    for file, anchor in links(path):
        target = (path.parent / file).resolve() if file else path
        if not target.exists():
            broken.append(f"{file} (no such file)")
        elif anchor is not None and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{file}#{anchor} (no such heading in {target.name})")
    return broken


@pytest.mark.parametrize("path", MARKDOWN, ids=_relative)
def test_every_relative_link_resolves(path):
    assert links(path) or path != README, "README links to nothing?"
    broken = broken_links(path)
    assert not broken, f"{_relative(path)}: " + "; ".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section, with `code`\n")
    page.write_text(
        "# Page\n\n[ok](other.md#a-section-with-code) [gone](missing.md) "
        "[bad anchor](other.md#nothing) ![img](missing.png) `[code](not-a-link.md)`\n"
        "[here](#page) [not here](#nowhere)\n"
    )
    assert broken_links(page) == [
        "missing.md (no such file)",
        "other.md#nothing (no such heading in other.md)",
        "missing.png (no such file)",
        "#nowhere (no such heading in page.md)",
    ]


def test_every_docs_page_is_linked_from_readme():
    linked = {(README.parent / file).resolve() for file, _ in links(README) if file}
    unlinked = [_relative(page) for page in PAGES if page.resolve() not in linked]
    assert not unlinked, f"README links to no {unlinked}"


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README has {len(lines)} lines: move detail into docs/"
    first_install = next((i for i, line in enumerate(lines) if "pip install" in line), None)
    assert first_install is not None, "README shows no `pip install`"
    assert first_install < 40, f"the first `pip install` is at line {first_install + 1}"


# --- commands ------------------------------------------------------------------------------

COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(make|python3?|torchrun|pip|bash|pytest)\s")


def commands(path):
    """The command lines a markdown file shows: its shell blocks' lines and inline code spans
    that start with a command (after environment assignments)."""
    found = []
    for info, code, _ in blocks(path):
        if info in SHELL:
            found += [line for line in code.splitlines() if COMMAND.match(line.strip() + " ")]
    for _, span in INLINE_CODE.findall(FENCE.sub("", path.read_text())):
        if COMMAND.match(span.strip() + " "):
            found.append(span)
    return list(dict.fromkeys(line.strip() for line in found))


def _make_targets():
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))


def _extras(setup_cfg):
    config = configparser.ConfigParser()
    config.read(setup_cfg)
    if not config.has_section("options.extras_require"):
        return set()
    return set(config["options.extras_require"])


def _options_of(script):
    """Every `--option` string a script, or a module beside it, defines."""
    text = "".join(p.read_text() for p in script.parent.glob("*.py"))
    return set(re.findall(r"[\"'](--[\w-]+)[\"']", text))


def _check_script(words, problems, line):
    script = next((w for w in words if w.endswith(".py") or w.endswith(".sh")), None)
    if script is None:
        return
    path = ROOT / script
    if not path.exists():
        problems.append(f"{line}: no {script}")
        return
    if script.endswith(".py"):
        options = _options_of(path)
        for word in words[words.index(script) + 1 :]:
            option = word.split("=", 1)[0]
            if option.startswith("--") and option not in options:
                problems.append(f"{line}: {script} has no {option}")


def _check_module(module, problems, line):
    local = ROOT / module.replace(".", "/")
    if local.with_suffix(".py").exists() or (local / "__main__.py").exists():
        return
    if module.split(".")[0] in {"amp", "benchmarks", "examples", "tests"}:
        problems.append(f"{line}: no module {module} in the repository")
    elif importlib.util.find_spec(module) is None:
        problems.append(f"{line}: no module {module}")


def _check_pip(words, problems, line):
    targets = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
    for target in targets:
        name, _, wanted = target.partition("[")
        wanted = {e.strip() for e in wanted.rstrip("]").split(",") if e.strip()}
        if name.startswith((".", "/")):
            if not (ROOT / name).exists():
                problems.append(f"{line}: no {name}")
            known = _extras(ROOT / name / "setup.cfg")
        elif name == "amp":
            known = _extras(ROOT / "setup.cfg")
        else:
            continue  # another package from the registry
        for extra in wanted - known:
            problems.append(f"{line}: no extra [{extra}] for {name}")


def _parts(line):
    """A command line's commands ([words]), split at `&&`, `;` and `|` outside quotes. A
    synopsis's optional group (`[--save DIR]`, `[--recipe O2\\|compact]`) counts as its option."""
    line = re.sub(r"\[(--?[\w-]+)[^\]]*\]", r"\1", line.split(" #", 1)[0])
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    parts, words = [], []
    for word in lexer:
        if word in (";", "&&", "|", "||", "&"):
            parts.append(words)
            words = []
        else:
            words.append(word)
    return parts + [words]


def command_problems(line):
    """What does not exist of one command line ([] when all of it does)."""
    problems = []
    try:
        parts = _parts(line)
    except ValueError:
        return [f"{line}: not a shell line"]
    for words in parts:
        while words and re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]
        if not words:
            continue
        program, rest = words[0], words[1:]
        if program == "make":
            for target in (w for w in rest if not w.startswith("-") and "=" not in w):
                if target not in _make_targets():
                    problems.append(f"{line}: no make target {target}")
        elif program in ("python", "python3"):
            if "-c" in rest:
                continue
            if "-m" in rest:
                module = rest[rest.index("-m") + 1]
                _check_module(module, problems, line)
                if module == "pip" and "install" in rest:
                    _check_pip(rest, problems, line)
                continue
            _check_script(rest, problems, line)
        elif program in ("torchrun", "bash"):
            _check_script(rest, problems, line)
        elif program == "pip" and "install" in rest:
            _check_pip(rest, problems, line)
        elif program == "pytest":
            for word in rest:
                if word.startswith("tests/") and not (ROOT / word.split("::")[0]).exists():
                    problems.append(f"{line}: no {word}")
    return problems


def test_readme_shows_commands():
    shown = commands(README)
    assert any(c.startswith("make ") for c in shown) and any("pip install" in c for c in shown)


@pytest.mark.parametrize("path", MARKDOWN, ids=_relative)
def test_every_command_shown_exists(path):
    problems = [p for line in commands(path) for p in command_problems(line)]
    assert not problems, "\n".join(problems)


def test_the_command_check_sees_what_does_not_exist():
    assert command_problems("make test-quick") == []
    assert command_problems("make tset") == ["make tset: no make target tset"]
    assert command_problems("python benchmarks/run_all.py --nope") == [
        "python benchmarks/run_all.py --nope: benchmarks/run_all.py has no --nope"
    ]
    assert command_problems("python examples/nowhere.py") == [
        "python examples/nowhere.py: no examples/nowhere.py"
    ]
    assert command_problems("python -m amp.casting.patch_report") == []
    assert command_problems("python -m amp.nothing") == [
        "python -m amp.nothing: no module amp.nothing in the repository"
    ]
    assert command_problems("pip install '.[cuda]'") == []
    assert command_problems("pip install '.[cudaa]'") == [
        "pip install '.[cudaa]': no extra [cudaa] for ."
    ]
    assert command_problems("AMP_REQUIRE_CUDA=1 make test") == []


# --- README's Python blocks ----------------------------------------------------------------


def python_blocks():
    params = []
    for info, code, before in blocks(README):
        if info not in ("python", "py"):
            continue
        last = before.rstrip("\n").rsplit("\n", 1)[-1]
        not_run = NOT_RUN.search(last)
        line = before.count("\n") + 1
        marks = [pytest.mark.skip(reason=not_run.group(1))] if not_run else []
        params.append(pytest.param(code, id=f"README.md:{line}", marks=marks))
    return params


def _needs(code):
    """The optional frameworks a block imports and this environment lacks."""
    wanted = set(re.findall(r"^\s*(?:from|import)\s+(lightning|transformers)\b", code, re.M))
    return sorted(name for name in wanted if importlib.util.find_spec(name) is None)


@pytest.mark.parametrize("code", python_blocks())
def test_readme_python_block_runs_as_pasted(code, tmp_path):
    missing = _needs(code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (pip install '.[{missing[0]}]')")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - start < 30, "a quick-start block should run in seconds"


def test_readme_has_runnable_python():
    assert len(python_blocks()) >= 4
