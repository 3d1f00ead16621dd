"""Kimi K3 through the official `openai` client: the tiny K3-format checkpoint of
fixtures/kimi-k3 (MXFP4 experts, AttnRes, gated MLA; random weights) served by
`kimi-infer serve`, which renders and parses K3's XTML format itself."""

import shutil
import tempfile
from pathlib import Path

from k3_xtml import check_k3_xtml

ROOT = Path(__file__).resolve().parents[2]


def test_k3_reasoning_and_tools_through_the_official_client():
    # A copy, so that the server's log never lands in the committed fixture.
    model_dir = tempfile.mkdtemp(prefix="kimi-k3-")
    for f in (ROOT / "fixtures" / "kimi-k3" / "k3-tiny-7l").iterdir():
        shutil.copy(f, model_dir)
    check_k3_xtml(model_dir)
