"""Rewrite README.md's table of config keys (between <!-- config-keys:start --> and
<!-- config-keys:end -->) from the keys' declarations in src/draftling/config/.

    python3 scripts/gen_config_table.py          # rewrite README.md
    python3 scripts/gen_config_table.py --check  # exit 1 when README.md's table is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from draftling.config.table import key_table_markdown, readme_section, replace_section  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"


def main(argv: list[str]) -> int:
    text = README.read_text(encoding="utf-8")
    table = key_table_markdown()
    if "--check" in argv:
        if readme_section(text) != table:
            print(f"{README}: the config key table is stale; run python3 scripts/gen_config_table.py")
            return 1
        return 0
    README.write_text(replace_section(text, table), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
