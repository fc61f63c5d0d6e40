"""`buf breaking` for `make lint`: the contracts in protos/ against the last release, so that a
change that breaks existing clients is a decision, not an accident.

    python protos/breaking.py path/to/buf

The baseline is the newest release tag reachable from HEAD (`git describe --match 'v*'`), or,
before the first release, HEAD~1 (main's previous commit). BUF_BREAKING_AGAINST overrides it with
any git revision; BUF_BREAKING_AGAINST=none skips the check, for a deliberate break only (the
#19 renames: the integrator tags v0.2.0 on their merge commit, and later commits compare
against it). The baseline is read from the repository's own git directory (buf's git input), so
it works in a worktree and in a fresh clone; a shallow clone without the baseline commit fails
with a message that says so.
"""

import os
import subprocess
import sys
from pathlib import Path

SKIP = "none"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def baseline(repo: Path) -> str | None:
    """The git revision to compare against, or None to skip."""
    override = os.environ.get("BUF_BREAKING_AGAINST", "").strip()
    if override:
        return None if override == SKIP else override
    tag = _git(repo, "describe", "--tags", "--abbrev=0", "--match", "v*")
    return tag.stdout.strip() if tag.returncode == 0 else "HEAD~1"


def check(buf: str, repo: Path) -> int:
    revision = baseline(repo)
    if revision is None:
        print(f"buf breaking: skipped (BUF_BREAKING_AGAINST={SKIP})")
        return 0
    commit = _git(repo, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    if commit.returncode != 0:
        print(f"buf breaking: git revision {revision!r} is not in this clone (a shallow clone? "
              "fetch more history, or set BUF_BREAKING_AGAINST to a revision)", file=sys.stderr)
        return 2
    git_dir = _git(repo, "rev-parse", "--path-format=absolute", "--git-common-dir").stdout.strip()
    sha = commit.stdout.strip()
    print(f"buf breaking: protos/ against {revision} ({sha[:12]})")
    return subprocess.run([buf, "breaking", "protos", "--against",
                           f"{git_dir}#ref={sha},subdir=protos"], cwd=repo).returncode


if __name__ == "__main__":
    sys.exit(check(sys.argv[1], Path(__file__).resolve().parent.parent))
