"""A bad input on several ranks is one line, printed once: through ``megarlhf ... --nproc-per-node 2`` with
nothing else on stderr, and under plain torchrun once among torchrun's own report."""
import os
import subprocess
import sys

RECIPE = "model: {path: MODEL}\ndata: {train_path: train.jsonl}\n"
EXPECTED = "megarlhf sft: error: model.path='{}' is not an HF model directory (no config.json there)"


def _recipe(tmp_path):
    (tmp_path / "recipe.yaml").write_text(RECIPE.replace("MODEL", str(tmp_path / "no-model")))
    return str(tmp_path / "recipe.yaml"), EXPECTED.format(tmp_path / "no-model")


def _run(cmd, tmp_path, **env):
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, **env}  # torchrun's banner would show
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


def test_megarlhf_launches_ranks_and_a_bad_input_is_one_line(tmp_path):
    recipe, expected = _recipe(tmp_path)
    temp = tmp_path / "temp"
    temp.mkdir()
    done = _run([sys.executable, "-m", "megarlhf", "sft", recipe, "--nproc-per-node", "2"], tmp_path, TMPDIR=str(temp))
    assert done.returncode == 1 and done.stderr == expected + "\n" and done.stdout == "", done.stderr
    # the launch leaves no directory of its agent behind (torch's own made one per run: torchelastic_*)
    assert [p.name for p in temp.iterdir() if p.name.startswith("torchelastic_")] == []


def test_under_torchrun_the_line_is_printed_once(tmp_path):
    recipe, expected = _recipe(tmp_path)
    done = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "megarlhf", "sft",
                 recipe], tmp_path)
    assert done.returncode == 1 and done.stderr.count("megarlhf sft: error:") == 1 and expected in done.stderr
