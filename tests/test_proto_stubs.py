"""The committed stubs in asyncdiloco/wire/_proto/ are what scripts/gen_proto.py makes now."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_committed_stubs_are_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    for name in gen.STUBS:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "asyncdiloco" / "wire" / "_proto" / name).read_text()
        assert fresh == committed, (
            f"asyncdiloco/wire/_proto/{name} is stale: run `python scripts/gen_proto.py` and commit"
        )
