"""mypy sees kvroute's public API with real types (python/kvroute/_native.pyi, exported by
kvroute/__init__.py under TYPE_CHECKING): a well-typed caller checks clean, and each
wrong-typed call in BAD is reported on its own line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "python"

GOOD = '''
from __future__ import annotations
import array
import numpy as np
import numpy.typing as npt
import kvroute
from kvroute import Decision, EventApplier, PrefixIndex, Router, RouterConfig, block_hashes

def route_one(router: Router, tokens: list[int]) -> tuple[str, int]:
    d: Decision = router.route(tokens, session="user-1", now=1.0)
    router.prefill_done(d.handle)
    router.finish(d.handle, now=2.0)
    return d.replica, d.cached_tokens

cfg: RouterConfig = RouterConfig(policy="ttft", block_size=16)
router = Router(cfg, ["a", "b"])
hashes: npt.NDArray[np.uint64] = block_hashes(np.arange(64, dtype=np.int32), 16, salt="m")
index: PrefixIndex = router.index
index.insert(0, hashes)
counts: npt.NDArray[np.int32] = index.match(array.array("Q", hashes.tolist()))
index.match(memoryview(array.array("Q", [1, 2])))
applier = EventApplier(index, cfg.block_size, salt=cfg.salt)
applied: bool = applier.apply(0, b"\\x90")
block: int = cfg.block_size
name, cached = route_one(router, list(range(48)))
stats: dict[str, object] = router.stats()
h: int = kvroute.xxh3_64(b"abc", 7)
'''

# Each line is one wrong call; mypy must flag every line (and nothing else).
BAD = '''
import numpy as np
from kvroute import EventApplier, PrefixIndex, Router, RouterConfig, block_hashes
router = Router(RouterConfig(), ["a"])
router.route(1.5)
router.route([1, 2], session=42)
block_hashes(np.arange(4), block_size="16")
PrefixIndex(2).match("abc")
router.add_replica(3)
x: str = router.route([1]).matched_blocks
EventApplier(router, 16)
Router(RouterConfig(), "ab", 3)
router.route_hashes([1], num_tokens=2.5)
'''
BAD_FIRST_CALL_LINE = 5


def _mypy(tmp_path: Path, files: dict[str, str]) -> tuple[int, str]:
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    env = dict(os.environ, MYPYPATH=str(SOURCE))
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental", "--cache-dir", os.devnull,
         "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}", *files],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_public_api_is_typed_for_mypy(tmp_path):
    rc, out = _mypy(tmp_path, {"good.py": GOOD, "bad.py": BAD})
    errors = [line for line in out.splitlines() if re.match(r"^\S+\.py:\d+: error", line)]
    assert not [e for e in errors if not e.startswith("bad.py:")], out
    flagged = {int(e.split(":")[1]) for e in errors}
    want = set(range(BAD_FIRST_CALL_LINE, len(BAD.splitlines()) + 1))
    assert flagged == want, out
    assert rc == 1, out
