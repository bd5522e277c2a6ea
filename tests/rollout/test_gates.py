"""megarlhf.rollout.sync.gates: the dtype rule (the coarser of trainer and engine dtypes picks the tolerances), the
calibration's floors (probe and natural samples) and when it checks the checkpoint bit for bit, config
overrides, and the gap check's messages (max and mean, nan fails, keys named)."""
import math

import pytest

from megarlhf.config import ConfigError, RunConfig, load_config
from megarlhf.core.dtypes import DTYPES
from megarlhf.rollout.sync.gates import FLOORS, calibration_problems, gap_problems, resolve_tolerances, run_tolerances
from megarlhf.config.train import GateConfig
from megarlhf.core.dtypes import coarser_dtype


def test_every_supported_dtype_has_tolerances_and_bf16_is_looser():
    assert set(FLOORS) == set(DTYPES)
    fp32, bf16 = FLOORS["float32"], FLOORS["bfloat16"]
    for name in ("probe_max", "probe_mean", "step0_max", "step0_mean", "step0_ppo_kl"):
        assert 0 < getattr(fp32, name) < getattr(bf16, name)


def test_the_coarser_dtype_decides():
    assert coarser_dtype("float32", "float32") == "float32"
    assert coarser_dtype("float32", "bfloat16") == coarser_dtype("bfloat16", "float32") == "bfloat16"
    assert resolve_tolerances("float32", "bfloat16", GateConfig()) == FLOORS["bfloat16"]
    tol = resolve_tolerances("float32", "float32", GateConfig(step0_max=5e-3))
    assert tol.step0_max == 5e-3 and tol.probe_max == FLOORS["float32"].probe_max


def test_run_config_resolves_from_model_and_rollout_dtypes():
    base = ["model.path=/m", "model.dtype=float32"]
    assert run_tolerances(load_config(RunConfig, None, base)) == FLOORS["float32"]
    assert run_tolerances(load_config(RunConfig, None, base + ["rollout.dtype=bfloat16"])) == FLOORS["bfloat16"]
    assert run_tolerances(load_config(RunConfig, None, ["model.path=/m"])) == FLOORS["bfloat16"]  # bf16 default
    assert run_tolerances(load_config(RunConfig, None, base + ["gates.probe_mean=0.5"])).probe_mean == 0.5


def test_calibration_scales_with_the_measured_noise_and_overrides_win():
    bf16 = FLOORS["bfloat16"]
    quiet = resolve_tolerances("bfloat16", "bfloat16", GateConfig(), floor=(0.01, 0.004))
    assert quiet == bf16  # below the floors: the floors stand
    noisy = resolve_tolerances("bfloat16", "bfloat16", GateConfig(), floor=(0.47, 0.08))  # SmolLM2-like
    assert noisy.probe_mean == noisy.step0_mean == pytest.approx(3 * 0.08)
    assert noisy.probe_max == noisy.step0_max == pytest.approx(5 * 0.47)
    assert noisy.step0_ppo_kl == bf16.step0_ppo_kl
    pinned = resolve_tolerances("bfloat16", "bfloat16", GateConfig(probe_mean=0.1), floor=(0.47, 0.08))
    assert pinned.probe_mean == 0.1 and pinned.step0_mean == pytest.approx(0.24)
    config = load_config(RunConfig, None, ["model.path=/m", "model.dtype=bfloat16"])
    assert calibration_problems(config, 0.08) == []
    assert "does not run the model the trainer loaded" in calibration_problems(config, 0.7)[0]
    # a freely routed MoE model's gap points to routing flips (its weights were compared bit for bit), not
    # to "a conversion error"; under r3 the replay is on and the general cause stands
    moe = calibration_problems(config, 0.7, is_moe=True)[0]
    assert "routed freely (algorithm.routing_replay='none')" in moe and "conversion error" not in moe
    replayed = load_config(RunConfig, None, ["model.path=/m", "model.dtype=bfloat16", "algorithm.routing_replay=r3"])
    assert "conversion error" in calibration_problems(replayed, 0.7, "the natural samples", True, replayed=True)[0]
    # ... except for the probe, whose random tokens no rollout routed
    assert "r3 does not reach the probe's random tokens" in calibration_problems(replayed, 0.7, is_moe=True)[0]
    with pytest.raises(ConfigError, match=r"gates\.step0_max must be > 0 or null"):
        load_config(RunConfig, None, ["model.path=/m", "gates.step0_max=0"])


def test_the_natural_floor_sets_the_step0_tolerances():
    """Step 0 is gated by the gap measured on natural samples (the same kind of tokens), the probe by the
    probe's: SmolLM2-like numbers, probe floor (0.40, 0.08), natural floor (0.50, 0.06)."""
    both = resolve_tolerances("bfloat16", "bfloat16", GateConfig(), floor=(0.40, 0.08), natural=(0.50, 0.06))
    assert both.probe_max == pytest.approx(5 * 0.40) and both.probe_mean == pytest.approx(3 * 0.08)
    assert both.step0_max == pytest.approx(5 * 0.50) and both.step0_mean == pytest.approx(3 * 0.06)
    natural_only = resolve_tolerances("bfloat16", "bfloat16", GateConfig(), natural=(0.50, 0.06))
    assert natural_only.probe_mean == FLOORS["bfloat16"].probe_mean and natural_only.step0_mean == both.step0_mean
    config = load_config(RunConfig, None, ["model.path=/m", "model.dtype=bfloat16"])
    assert "gap of the natural samples is 0.7" in calibration_problems(config, 0.7, "the natural samples")[0]


def test_calibration_checks_the_checkpoint_unless_the_engine_rounds_finer():
    from megarlhf.rollout.sync.calibration import checks_checkpoint, natural_sampling

    base = ["model.path=/m", "rollout.max_new_tokens=4096", "rollout.temperature=0.7"]
    assert checks_checkpoint(load_config(RunConfig, None, base + ["model.dtype=float32"]))
    assert checks_checkpoint(load_config(RunConfig, None, base + ["model.dtype=float32", "rollout.dtype=bfloat16"]))
    assert not checks_checkpoint(load_config(RunConfig, None, base + ["rollout.dtype=float32"]))  # bf16 trainer
    assert not checks_checkpoint(load_config(RunConfig, None, base + ["rollout.weight_sync.check_checkpoint=false"]))
    sampling = natural_sampling(load_config(RunConfig, None, base + ["rollout.n_samples=3"]), (7,))
    assert (sampling.n, sampling.temperature, sampling.stop_token_ids) == (3, 0.7, (7,))
    assert sampling.max_new_tokens == 2048 and sampling.seed is not None  # capped at probe_max_length, seeded
    with pytest.raises(ConfigError, match="calibration_prompts must be an int >= 0"):
        load_config(RunConfig, None, base + ["rollout.weight_sync.calibration_prompts=-1"])


def test_gap_problems_name_the_statistic_and_key():
    assert gap_problems("probe", 1e-5, 1e-6, 1e-4, 1e-5, ("probe_max", "probe_mean")) == []
    problems = gap_problems("probe", 2e-4, 2e-5, 1e-4, 1e-5, ("probe_max", "probe_mean"))
    assert problems == ["probe: max |trainer - engine| log-prob gap 0.0002 > 0.0001 (gates.probe_max)",
                        "probe: mean |trainer - engine| log-prob gap 2e-05 > 1e-05 (gates.probe_mean)"]
    assert len(gap_problems("probe", math.nan, 0.0, 1.0, 1.0, ("a", "b"))) == 1  # nan never passes


def test_calibration_prompts_split_over_the_replicas_keep_their_seeds():
    """Each data-parallel replica samples its share of the calibration prompts; together the shares are
    every prompt once, each with the seed one replica sampling them all would give it."""
    from types import SimpleNamespace

    from megarlhf.rollout.engines.sampling import SamplingConfig
    from megarlhf.rollout.sync.calibration import replica_share

    prompts = [[i, i + 1] for i in range(5)]
    whole = SamplingConfig(n=3, temperature=1.0, max_new_tokens=4, seed=1000)
    seen = {}
    for rank in range(2):
        mine, indices = replica_share(prompts, SimpleNamespace(dp=SimpleNamespace(rank=rank, size=2)))
        sampling = whole.for_prompts(indices)
        sampling.validate(len(mine))
        seen.update({tuple(p): sampling.prompt_seed(k) for k, p in enumerate(mine)})
    assert seen == {tuple(p): whole.prompt_seed(i) for i, p in enumerate(prompts)}
    mine, _ = replica_share(prompts[:1], SimpleNamespace(dp=SimpleNamespace(rank=1, size=2)))
    assert mine == []  # more replicas than prompts: this one measures nothing
    every, _ = replica_share(prompts, SimpleNamespace(dp=SimpleNamespace(rank=1, size=2)), engine_tp=2)
    assert every == prompts  # one engine over both ranks: each of its ranks passes the same prompts
