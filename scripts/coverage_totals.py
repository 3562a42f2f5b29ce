"""Print the line and branch totals of a coverage.py JSON report: ``python scripts/coverage_totals.py FILE``.

`make coverage` ends with this line, the two numbers a change to the tests must not lower.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def totals(path: Path) -> str:
    """``lines covered/statements = p%; branches covered/total = q%`` of the report at ``path``."""
    t = json.loads(path.read_text())["totals"]
    lines = f"lines {t['covered_lines']}/{t['num_statements']} = {t['covered_lines'] / t['num_statements']:.2%}"
    branches = t["covered_branches"] / t["num_branches"]
    return f"{lines}; branches {t['covered_branches']}/{t['num_branches']} = {branches:.2%}"


if __name__ == "__main__":
    print(totals(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/coverage/coverage.json")))
