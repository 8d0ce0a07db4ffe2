"""`kvl bench` byte accounting: the lower bounds in bench/RESULTS.md rest on it, so it is checked
against what the engine actually read and against the pack's own index (no timing is asserted)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvl.bench import PAGE, pack_bytes
from kvl.packfmt import PackReader


def _limits_file(tmp_path: Path) -> Path:
    # fixed limits: this test checks bytes, never speed
    path = tmp_path / "limits.jsonl"
    path.write_text(json.dumps({"mode": "dram", "best_bytes_per_s": 10e9}) + "\n"
                    + json.dumps({"mode": "ssd", "bytes_per_s": 1e9}) + "\n")
    return path


def test_pack_bytes_match_the_index(tiny_pack: Path) -> None:
    reader = PackReader(tiny_pack)
    trunk = reader.stores["trunk"].records
    experts = reader.stores["experts"].records
    pb = pack_bytes(tiny_pack)
    embed = next(r for r in trunk if r.name.endswith("embed_tokens.weight"))
    assert pb.trunk_used == sum(r.nbytes for r in trunk) - embed.nbytes
    assert pb.n_extents == len(experts)
    # every extent starts 4 KiB-aligned, so one padded extent is what a cache miss reads
    assert all(r.offset % PAGE == 0 for r in experts)
    assert pb.extent_padded % PAGE == 0 and pb.extent_padded - PAGE < pb.extent_data <= pb.extent_padded
    hp = reader.hparams
    assert pb.n_moe_layers * int(hp["text.n_routed_experts"]) == len(experts)


def test_cold_prompt_reads_each_distinct_expert_once(tiny_pack: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # a one-chunk prompt with a cache that holds every expert: nothing is evicted, so the bytes
    # read must be exactly (distinct experts) x (padded extent)
    proc = subprocess.run(
        [sys.executable, "-m", "kvl", "bench", str(tiny_pack), "--prompt-lens", "24",
         "--decode-tokens", "3", "--cache-mib", "64", "--ram-mib", "1024",
         "--limits", str(_limits_file(tmp_path)), "--json", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    pb = pack_bytes(tiny_pack)
    run = result["runs"][0]
    cold = run["cold_prompt"]
    assert cold["tokens"] == 24
    assert 0 < cold["distinct_experts"] <= pb.n_extents
    assert cold["expert_bytes_read"] == cold["distinct_experts"] * pb.extent_padded
    decode = run["decode_after_cold"]
    assert decode["tokens"] == 3 and decode["context_start"] == 24
    # the bound uses the fixed limits given above
    assert decode["bound_ram_s"] == decode["ram_bytes_per_token"] / 10e9
    assert result["peak_rss_bytes"] > 0


def test_adjacent_probes_bracket_each_decode(tiny_pack: Path, tmp_path: Path) -> None:
    # bench/membw.c is the probe: build it as bench/run_all.sh does
    membw = tmp_path / "membw"
    repo = Path(__file__).resolve().parent.parent
    subprocess.run(["gcc", "-std=c11", "-O2", "-mavx2", "-mfma", str(repo / "bench" / "membw.c"),
                    "-lpthread", "-o", str(membw)], check=True)
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvl", "bench", str(tiny_pack), "--prompt-lens", "8",
         "--decode-tokens", "2", "--limits", str(_limits_file(tmp_path)), "--membw", str(membw),
         "--json", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    decode = json.loads(out.read_text())["runs"][0]["decode_after_cold"]
    adj = decode["adjacent"]
    for probe in (adj["before"], adj["after"]):
        assert probe["dram_bytes_per_s"] > 0 and probe["ssd_bytes_per_s"] > 0
    assert adj["dram_bytes_per_s"] == (adj["before"]["dram_bytes_per_s"]
                                       + adj["after"]["dram_bytes_per_s"]) / 2
    assert adj["bound_s"] >= decode["ram_bytes_per_token"] / adj["dram_bytes_per_s"]
    assert adj["ratio"] == decode["s_per_token_mean"] / adj["bound_s"]
