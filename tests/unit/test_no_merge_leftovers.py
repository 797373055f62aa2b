"""No file of the repository keeps a merge's conflict markers: two of them once stayed in CHANGELOG.md and in a
module's docstring (where Python reads them as text) after a merge, and nothing else would have noticed."""

import re
import subprocess

from helpers import REPO

MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)
TEXT = (".py", ".md", ".sh", ".json", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".cpp", ".h", ".cu", ".sbatch")


def test_no_tracked_file_holds_conflict_markers():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        if not name.endswith(TEXT):
            continue
        try:
            with open(f"{REPO}/{name}", encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        for m in MARKER.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            if m.group(1).startswith("=") and not re.search(r"^<{7} ", text[: m.start()], re.MULTILINE):
                continue  # a line of seven '=' alone (a reStructuredText table's rule) without an opening marker
            found.append(f"{name}:{line}")
    assert not found, f"conflict markers left by a merge: {found}"
