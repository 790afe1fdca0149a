"""Which quantization is recommended, by the quality measured here (issue 56): the smallest variant whose mean KL
divergence from the reference is within the budget, else the bits rule, each tagged with where it comes from.

Expected values come from outside the code under test: llama.cpp's own scoreboard (tools/perplexity/README.md of
the pinned source, LLaMA 3 8B, no imatrix: Q8_0 7.96 GiB KLD 0.001355, Q6_K 6.14 GiB 0.005452, Q5_K_M 5.33 GiB
0.010762, Q4_K_M 4.58 GiB 0.031273), and in the end-to-end test the figures the real llama-perplexity reported for
files the real llama-quantize wrote, pulled from a stand-in Hub into a Hub cache as users have them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fakehub import FakeHub

from desktop.core.planning.quant_choice import BITS_RULE, MeasuredQuant, choose

GIB = 1 << 30
SCOREBOARD = {"Q8_0": (7.96, 0.001355), "Q6_K": (6.14, 0.005452), "Q5_K_M": (5.33, 0.010762),
              "Q4_K_M": (4.58, 0.031273)}
SWITCHYARD = [sys.executable, "-m", "desktop"]


def _measured(names: list[str]) -> dict[str, MeasuredQuant]:
    return {q: MeasuredQuant(q, SCOREBOARD[q][1], None, "llama-3-8b-F16.gguf", 7, "2026-12-07") for q in names}


def _pick(budget: float, measured: list[str], fits: list[str] | None = None) -> tuple[str | None, str, str]:
    candidates = fits or list(SCOREBOARD)
    choice = choose(candidates, lambda q: q, lambda q: SCOREBOARD[q][0], lambda qs: max(qs, key=SCOREBOARD.get),
                    _measured(measured), budget, "llama-3-8b")
    return choice.pick, choice.basis, choice.reason


def test_the_smallest_measured_within_the_budget_is_recommended() -> None:
    everything = list(SCOREBOARD)
    assert _pick(0.05, everything)[:2] == ("Q4_K_M", "measured here on 2026-12-07")  # 0.0313 <= 0.05
    pick, basis, reason = _pick(0.01, everything)  # Q5_K_M 0.0108 and Q4_K_M 0.0313 are over 0.01
    assert (pick, basis) == ("Q6_K", "measured here on 2026-12-07")
    assert "smaller ones are over it: Q4_K_M (mean KLD 0.0313" in reason and "Q5_K_M (mean KLD 0.0108" in reason
    assert "run #7" in reason
    # only what fits is a candidate: with Q8_0 alone fitting, it is the pick even under a budget Q4_K_M meets
    assert _pick(0.05, everything, fits=["Q8_0"])[:2] == ("Q8_0", "measured here on 2026-12-07")


def test_what_was_not_measured_is_named_with_the_action_that_measures_it() -> None:
    pick, basis, reason = _pick(0.01, ["Q8_0", "Q6_K"])
    assert (pick, basis) == ("Q6_K", "measured here on 2026-12-07")
    assert "Q4_K_M,Q5_K_M not measured: `switchyard quality llama-3-8b --variants Q4_K_M,Q5_K_M`" in reason


def test_nothing_measured_within_is_the_bits_rule_and_says_so() -> None:
    pick, basis, reason = _pick(0.05, [])
    assert (pick, basis) == ("Q8_0", BITS_RULE) and reason.startswith("Q8_0 by the bits rule, not measured here")
    # measured over the budget: left out of the bits rule while something else remains
    pick, basis, reason = _pick(0.001, ["Q8_0"])
    assert (pick, basis) == ("Q6_K", BITS_RULE)
    assert "measured over the 0.001 budget: Q8_0 (mean KLD 0.0014" in reason
    assert _pick(0.001, everything := list(SCOREBOARD))[:2] == ("Q8_0", BITS_RULE), everything  # all over


def test_a_budget_that_is_no_number_is_refused(tmp_path: Path) -> None:
    from desktop.core.common.errors import SwitchyardError
    from desktop.core.storage import settings

    for bad in (0.0, -0.1, float("nan"), 11.0):
        with pytest.raises(SwitchyardError, match="quality budget"):
            settings.Settings(kld_budget=bad).validated()
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"version": 4, "price_per_kwh": 0.3}))
    assert settings.load(path).kld_budget == 0.05  # a v4 file gets the default, keeps the rest
    assert settings.load(path).price_per_kwh == 0.3


# --- end to end: the files users pull, measured by the real tools, and what `variants` then recommends --------
def _cli(env: dict[str, str], *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*SWITCHYARD, *args], env=env, capture_output=True, text=True, timeout=timeout)  # noqa: S603
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _recommended(env: dict[str, str], repo: str) -> dict[str, Any]:
    listing = json.loads(_cli(env, "variants", repo, "--json", timeout=120).stdout)
    picks = [v for v in listing["variants"] if v["recommended"]]
    assert len(picks) == 1, listing
    return {**picks[0], "all": {v["name"]: v for v in listing["variants"]}}


@pytest.mark.engine
@pytest.mark.llamacpp
def test_a_pulled_repo_is_recommended_by_its_measured_quality(tmp_path: Path, llama_install: Any,
                                                              demo_model: Any) -> None:
    """The demo's float32 file and its Q8_0 and Q4_K_M copies (written by the pinned llama-quantize) in a stand-in
    Hub repo, pulled into a Hub cache; `switchyard quality` on the pulled files; then `switchyard variants`:
    unmeasured, Q8_0 by the bits rule; measured, Q8_0 again under the default budget 0.05 because the demo's
    Q4_K_M measures over it (its KLD is read from the tool's report, not assumed); with a budget of 0.5 in the
    settings, Q4_K_M: the smallest within it, which the bits rule never picks."""
    from desktop.core.engines import get_adapter
    from desktop.core.measure.quality import variant_files

    reference = Path(demo_model.gguf_path)
    copies = variant_files(llama_install, reference, ["Q8_0", "Q4_K_M"], get_adapter("llama.cpp"))
    repo = "demo/switchyard-demo-GGUF"
    files: dict[str, bytes | Path] = {"demo-F32.gguf": reference, "demo-Q8_0.gguf": copies["Q8_0"],
                                      "demo-Q4_K_M.gguf": copies["Q4_K_M"]}
    home = tmp_path / "home"
    with FakeHub() as hub:
        hub.add_repo(repo, files, tags=["gguf"])
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "hf-cache"),
                   SWITCHYARD_HOME=str(home), SWITCHYARD_NO_KEYRING="1", HF_HUB_DISABLE_IMPLICIT_TOKEN="1")
        pulled = {quant: Path(_cli(env, "pull", f"{repo}:{quant}", timeout=120).stdout.strip())
                  for quant in ("F32", "Q8_0", "Q4_K_M")}
        assert all("models--demo--switchyard-demo-GGUF" in str(p) and p.is_symlink() for p in pulled.values())

        unmeasured = _recommended(env, repo)
        assert (unmeasured["name"], unmeasured["basis"]) == ("Q8_0", BITS_RULE), unmeasured
        assert all(v["mean_kld"] is None for v in unmeasured["all"].values())

        report = json.loads(_cli(env, "quality", str(pulled["F32"]), "--variants",
                                 f"{pulled['Q8_0']},{pulled['Q4_K_M']}", "--long-ctx", "0", "--json").stdout)
        kld = {v["variant"]: v["mean_kld"] for v in report["variants"]}
        assert kld["demo-Q8_0.gguf"] < 0.05 < kld["demo-Q4_K_M.gguf"], kld  # the tool's figures decide the rest
        today = time.strftime("%Y-%m-%d")

        measured = _recommended(env, repo)
        assert (measured["name"], measured["basis"]) == ("Q8_0", f"measured here on {today}"), measured
        assert measured["all"]["Q4_K_M"]["mean_kld"] == kld["demo-Q4_K_M.gguf"]
        assert measured["all"]["F32"]["mean_kld"] == 0.0  # the reference itself
        assert f"Q4_K_M (mean KLD {kld['demo-Q4_K_M.gguf']:.4f}" in measured["reason"], measured["reason"]

        over = _cli(env, "recommend", str(pulled["Q4_K_M"]), timeout=120).stdout
        assert f"Q4_K_M: mean KLD {kld['demo-Q4_K_M.gguf']:.4f} against demo-F32.gguf, over the 0.05 quality " \
               f"budget (measured here on {today}" in over and \
               f"; Q8_0 (mean KLD {kld['demo-Q8_0.gguf']:.4f}) is within it: serve that file" in over, over

        settings_file = _settings_file(env)
        settings_file.parent.mkdir(parents=True, exist_ok=True)
        settings_file.write_text(json.dumps({"version": 5, "kld_budget": 0.5}))
        generous = _recommended(env, repo)
        assert (generous["name"], generous["basis"]) == ("Q4_K_M", f"measured here on {today}"), generous

        advice = _cli(env, "recommend", str(pulled["Q4_K_M"]), timeout=120).stdout
        assert f"Q4_K_M: mean KLD {kld['demo-Q4_K_M.gguf']:.4f} against demo-F32.gguf, within the 0.5 " \
               "quality budget" in advice, advice


def _settings_file(env: dict[str, str]) -> Path:
    """Where the CLI run with `env` reads its settings (asked of the app, not assumed)."""
    code = "from desktop.core.storage.settings import settings_path; print(settings_path())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,  # noqa: S603
                          check=True)
    return Path(done.stdout.strip())


# --- the reference does not fit: the largest variant that does takes its place, said so ------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
def test_a_reference_that_does_not_fit_gives_way_to_the_largest_variant_that_does(
        llama_install: Any, demo_model: Any) -> None:
    """A machine whose memory holds the demo's Q8_0 copy but not its float32 original (sizes read off the files):
    Q8_0 becomes the reference, Q4_K_M is scored against it by the real tool, and the report says so."""
    from desktop.core.common.errors import SwitchyardError
    from desktop.core.engines import get_adapter
    from desktop.core.measure.quality import SHIPPED_CORPUS, measure, variant_files

    reference = Path(demo_model.gguf_path)
    copies = variant_files(llama_install, reference, ["Q8_0", "Q4_K_M"], get_adapter("llama.cpp"))
    room = copies["Q8_0"].stat().st_size
    assert reference.stat().st_size > room > copies["Q4_K_M"].stat().st_size
    report = measure(llama_install, "demo", reference, copies, SHIPPED_CORPUS, fits=lambda size: size <= room,
                     long_ctx=0)
    assert Path(report.reference) == copies["Q8_0"] and [v.variant for v in report.variants] == ["Q4_K_M"]
    assert report.variants[0].mean_kld > 0
    assert report.reference_note.startswith(f"the reference {reference.name} (") and \
        "Q8_0, the highest-precision variant that does, is the reference instead" in report.reference_note
    with pytest.raises(SwitchyardError, match="does not fit this machine's free memory, and no variant"):
        measure(llama_install, "demo", reference, copies, SHIPPED_CORPUS, fits=lambda size: False)


# --- the A/B across formats: the quality gap beside the speed gap -----------------------------------------------
def test_an_ab_across_formats_labels_each_sides_weights_and_measured_quality(demo_model: Any, tmp_path: Path) -> None:
    """The weights are read off the files (the GGUF header's file type, the checkpoint's plan), the figures are
    the pinned llama-perplexity's own report of the demo's Q4_K_M (tests/data/llama-perplexity-kld.txt)."""
    from desktop.core.measure.quality_gap import gap_line, sides, weights_of

    reference = Path(demo_model.gguf_path)
    q4 = tmp_path / "Q4_K_M.gguf"
    q4.write_bytes(b"")  # named as llama-quantize's copies are; only the name is read
    assert weights_of(str(reference), {}) == "F32"  # the demo generator writes float32 tensors
    assert weights_of(str(demo_model.hf_dir), {"dtype": "float32"}) == "F32"
    quality = {"reference": str(reference), "run_id": 3, "run_date": "2026-12-07",
               "variants": [{"variant": "Q4_K_M", "mean_kld": 0.083516, "same_top": 0.83924}]}
    found = sides([("llama.cpp", str(q4), {}), ("vllm", str(demo_model.hf_dir), {"dtype": "float32"})], quality)
    line = gap_line(found, "demo")
    assert line == ("different weights: llama.cpp Q4_K_M (mean KLD 0.0835, same top token 83.9%, measured here on "
                    "2026-12-07 (run #3)) vs vllm F32 (the reference's precision); the speed gap includes the "
                    "precision gap"), line
    unmeasured = gap_line(sides([("llama.cpp", str(q4), {}), ("vllm", str(demo_model.hf_dir),
                                                              {"dtype": "float32"})], None), "demo")
    assert "quality not measured here" in unmeasured and "`switchyard quality demo --variants ...`" in unmeasured
    same = gap_line(sides([("llama.cpp", str(reference), {}), ("vllm", str(demo_model.hf_dir),
                                                                 {"dtype": "float32"})], None), "demo")
    assert same == "same weights on both sides (F32): the gap is the engines'"


# --- long context apart ---------------------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
def test_positions_deep_in_a_long_context_are_reported_apart(llama_install: Any, demo_model: Any,
                                                            tmp_path: Path) -> None:
    """Chunks of 512 tokens beside the 128-token ones: positions 256-511, scored by the real tool. The shipped
    corpus is 36 chunks of 256 tokens in the captured report (tests/data/llama-perplexity-kld.txt), so 18 chunks of
    512, each scoring 512 - 1 - 256 = 255 positions: 4590 by hand. A corpus too short for the long chunks says
    so instead of failing; one too short for the short chunks is a clear error before any variant runs."""
    from desktop.core.common.errors import SwitchyardError
    from desktop.core.engines import get_adapter
    from desktop.core.measure.quality import SHIPPED_CORPUS, measure, variant_files

    reference = Path(demo_model.gguf_path)
    q4 = variant_files(llama_install, reference, ["Q4_K_M"], get_adapter("llama.cpp"))
    env = dict(os.environ, SWITCHYARD_HOME=str(tmp_path / "home"))
    report = json.loads(_cli(env, "quality", "demo", "--variants", "Q4_K_M", "--ctx", "128", "--long-ctx", "512",
                             "--json").stdout)
    deep = report["long_context"]
    assert deep is not None and deep["positions"] == "256-511" and "note" not in deep, deep
    figures = deep["variants"]["Q4_K_M"]
    assert figures["tokens"] == 18 * 255 and figures["mean_kld"] > 0 and figures["same_top"] < 1, figures
    advice = _cli(env, "recommend", "demo", timeout=120).stdout  # from the run kept in history
    assert f"at positions 256-511 of 512-token chunks: mean KLD {figures['mean_kld']:.4f}" in advice, advice

    short = tmp_path / "short.txt"
    short.write_text(SHIPPED_CORPUS.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    brief = measure(llama_install, "demo", reference, q4, short, ctx=128, long_ctx=2048)
    assert brief.variants[0].mean_kld > 0 and brief.long_context is not None
    assert brief.long_context["note"].startswith("long-context positions not scored: short.txt is "), brief.long_context
    with pytest.raises(SwitchyardError, match="short.txt is .* tokens long; 2048-token chunks need at least 4096"):
        measure(llama_install, "demo", reference, q4, short, ctx=2048, long_ctx=0)


# --- the recommender on a checkpoint: the GGUF rung it advises, by the quality measured here ----------------------
@pytest.mark.parametrize("machine, budget, bits_rule, measured_pick", [
    ("cpu_laptop", 0.01, "Q4_K_M", "Q6_K"),  # a CPU's usual balance is Q4_K_M; measured over 0.01, Q6_K is within
    ("rtx4090", 0.05, "Q8_0", "Q4_K_M"),  # the bits rule's most bits that fit; Q4_K_M measured within 0.05
])
def test_the_recommender_advises_the_smallest_rung_measured_within_the_budget(machine: str, budget: float,
                                                                              bits_rule: str,
                                                                              measured_pick: str) -> None:
    """LLaMA 3 8B's config, with llama.cpp's own scoreboard figures (module docstring) as this machine's quality
    run: the advice moves from the bits rule's rung to the smallest one within the budget, and says why."""
    from test_recommend import LLAMA_8B, snap

    from desktop.core.models.facts import facts_from_config
    from desktop.core.planning.evidence import Evidence
    from desktop.core.planning.recommend import Workload, recommend

    facts = facts_from_config(LLAMA_8B)
    work = Workload(concurrency=1, lifetime_hours=1, restarts_per_day=30)
    unmeasured = recommend(facts, snap(machine), work, kld_budget=budget)
    assert (unmeasured.engine, unmeasured.quant) == ("llama.cpp", bits_rule), unmeasured.reasons
    assert not any("mean KLD" in r for r in unmeasured.reasons)
    evidence = Evidence(facts.name, "here", quality={
        "reference": "llama-3-8b-F16.gguf", "run_id": 4, "run_date": "2026-12-07",
        "variants": [{"variant": q, "mean_kld": kld, "same_top": None} for q, (_, kld) in SCOREBOARD.items()]})
    advised = recommend(facts, snap(machine), work, evidence=evidence, kld_budget=budget)
    assert (advised.engine, advised.quant) == ("llama.cpp", measured_pick), advised.reasons
    kld = SCOREBOARD[measured_pick][1]
    assert any(r.startswith(f"{measured_pick}: mean KLD {kld:.4f} against llama-3-8b-F16.gguf, within the "
                            f"{budget:g} quality budget (measured here on 2026-12-07, run #4)") for r in advised.reasons)
