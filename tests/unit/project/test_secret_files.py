"""Token and dotenv files stay where they are: never committed, never synced to a cluster with
the project, and created readable by their owner alone wherever the docs say how to make one.
(`raytrain submit` leaving them out of a job's upload: tests/unit/api/test_jobs_input.py.)"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
import yaml
from paths import ROOT
from ray._private.thirdparty.pathspec import PathSpec

CLUSTER = ROOT / "cluster"
GUIDES = sorted((ROOT / "docs").rglob("*.md"))  # SLURM and Ray clusters among them
LAUNCHERS = sorted(CLUSTER.glob("*.yaml"))
SECRETS = [
    "cluster/ray-token",
    "auth_token",
    "deploy/prod.token",
    ".env",
    "sub/.env.local",
    ".envrc",
]
KEPT = ["cluster/README.md", "configs/quickstart.yaml", "raytrain_app/cli.py", "environment.yml"]


def test_git_ignores_token_and_dotenv_files():
    """With the matcher Ray also applies to .gitignore when it packs a working dir."""
    ignored = PathSpec.from_lines("gitwildmatch", (ROOT / ".gitignore").read_text().splitlines())
    assert [name for name in SECRETS if not ignored.match_file(name)] == []
    assert [name for name in KEPT if ignored.match_file(name)] == []


def _rsync_excludes(patterns: list[str], path: str) -> bool:
    """Whether rsync's ``--exclude`` patterns leave out ``path`` (relative to the transfer's
    root): a leading / anchors a pattern at the root, any other matches the end of the path
    or of a folder above it, which takes everything inside along."""
    parts = path.split("/")
    for pattern in patterns:
        if pattern.startswith("/"):
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            if any(fnmatch.fnmatchcase(prefix, pattern[1:]) for prefix in prefixes):
                return True
            continue
        pattern = pattern.removeprefix("**/")
        depth = pattern.count("/") + 1
        ends = ["/".join(parts[max(0, i + 1 - depth) : i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(end, pattern) for end in ends):
            return True
    return False


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=[p.name for p in LAUNCHERS])
def test_the_project_sync_leaves_secrets_out_but_the_token_still_reaches_the_nodes(launcher):
    config = yaml.safe_load(launcher.read_text())
    excludes = config["rsync_exclude"]
    mounts = config["file_mounts"]
    assert mounts["~/raytrain_app"] == "."  # the project, synced from the repository root
    assert [name for name in SECRETS if not _rsync_excludes(excludes, name)] == []
    assert [name for name in KEPT if _rsync_excludes(excludes, name)] == []
    # The token's own mount sends one file, whose name rsync sees without its folder.
    token = Path(mounts["~/.ray/auth_token"])
    assert token == Path("cluster/ray-token")
    assert not _rsync_excludes(excludes, token.name)


def _commands(text: str) -> list[str]:
    """The lines of ``text``, a command continued with a trailing backslash joined up (in a
    YAML comment too)."""
    commands: list[str] = []
    continued = False
    for line in text.splitlines():
        line = line.strip()
        if continued:
            line = commands.pop() + " " + line.lstrip("#").strip()
        continued = line.endswith("\\")
        commands.append(line.removesuffix("\\"))
    return commands


def _token_writing_commands() -> list[tuple[str, str]]:
    """Every command of the cluster docs and configs that writes a token to a file."""
    found = []
    for path in [*CLUSTER.rglob("*.md"), *CLUSTER.rglob("*.yaml"), ROOT / "README.md", *GUIDES]:
        for command in _commands(path.read_text()):
            if re.search(r">\s*\S*token", command):
                found.append((str(path.relative_to(ROOT)), command))
    return found


def test_every_token_file_the_docs_create_is_private_from_its_first_byte():
    """``umask 077`` for the command that writes it, not a ``chmod 600`` after: in between,
    anyone on the machine may read it."""
    commands = _token_writing_commands()
    written = " ".join(command for _, command in commands)
    assert "> cluster/ray-token" in written and "> ~/.ray/raytrain-k8s-token" in written
    assert [(path, command) for path, command in commands if "umask 077" not in command] == []
