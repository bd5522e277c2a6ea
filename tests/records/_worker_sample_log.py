"""Rank script for tests/records/test_sample_log.py: SampleLog at DP=2 and at TP=2 on 2 ranks.

Each data-parallel replica holds its own share of the batch: replica r's samples are r*10 + k. At DP=2
the file must hold the first samples of the whole batch (replica 0's, then replica 1's), at TP=2 the one
replica's, each written once.
"""
import sys
from pathlib import Path

from megarlhf.data.prompts import PromptExample
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.records.sample_log import SampleLog
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel, shutdown


class _Tokenizer:
    def decode(self, ids, skip_special_tokens):
        return " ".join(f"t{i}" for i in ids)


def _share(replica: int, count: int):
    examples = [PromptExample(replica, f"prompt {replica}", [1], str(replica))]
    rollout = RolloutBatch(prompt_index=[0] * count, prompt_ids=[[1]] * count,
                           response_ids=[[replica * 10 + k] for k in range(count)], finish_reasons=["stop"] * count)
    return examples, rollout, [float(replica)] * count


def main() -> None:
    out_dir = Path(sys.argv[1])
    for tp in (1, 2):
        runtime = init_parallel(ParallelConfig(tensor_model_parallel_size=tp), seed=1)
        log = SampleLog(out_dir / f"tp{tp}", _Tokenizer(), per_step=3, runtime=runtime)
        log.write(0, "eval", *_share(runtime.dp.rank, 2))  # 2 per replica: the first 3 span both at DP=2
        log.write(1, "eval", *_share(runtime.dp.rank, 0 if runtime.dp.rank == 0 else 2))  # rank 0's share empty
    shutdown()


if __name__ == "__main__":
    main()
