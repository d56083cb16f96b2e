"""The README leads with the serving-stack plugins and lists every doc page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _sections() -> list[str]:
    return re.findall(r"^## (.+)$", README, flags=re.M)


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def test_the_plugins_come_before_the_install():
    sections = _sections()
    assert "Use with vLLM or SGLang" in sections
    assert sections.index("Use with vLLM or SGLang") < sections.index("Install")


def test_the_plugin_section_says_how_to_enable_and_what_wins():
    text = _section("Use with vLLM or SGLang")
    assert "pip install /path/to/hisparse-triton" in text      # the one-line enablement
    for entry_point in ("vllm.general_plugins", "sglang.srt.plugins"):
        assert entry_point in text
    # The precedence rules as the plugin pages state them.
    vllm, sglang = ((ROOT / "docs" / name).read_text(encoding="utf-8")
                    for name in ("vllm.md", "sglang.md"))
    assert "vLLM's compiled ops win unless overridden" in text and \
        "vLLM's compiled ops win unless overridden" in vllm
    for value in ("HISPARSE_TRITON_VLLM_OVERRIDE=1", "=all"):
        assert value in text
    assert "REPLACE" in text and "registered last wins" in sglang
    for variable in ("VLLM_PLUGINS", "SGLANG_PLUGINS"):
        assert variable in text
    assert "(docs/vllm.md)" in text and "(docs/sglang.md)" in text


def test_every_doc_page_is_in_the_readme_docs_list():
    listed = re.search(r"^docs/\s+(.+?)\n(?=\S)", README, flags=re.M | re.S)
    assert listed, "the README's layout has no docs/ line"
    names = set(re.findall(r"[\w-]+\.md", listed.group(1)))
    pages = {path.name for path in (ROOT / "docs").glob("*.md")}
    assert pages <= names, f"doc pages missing from the README's docs list: " \
                           f"{sorted(pages - names)}"
