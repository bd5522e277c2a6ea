"""The transformers backend: a rollout engine on plain HF transformers + torch, no vLLM needed.

It keeps the contract of :mod:`megarlhf.rollout.engines.api` with its own batched decode loop: prompts are
prefilled once and their KV cache repeated for the ``n`` samples, every step feeds all live rows together,
and finished rows are dropped from the cache once enough of them have accumulated. ``model.generate`` is
not used because the RL contract needs one seeded generator per sample (sample ``j`` of prompt ``i`` draws
from ``torch.Generator(seed + i * n + j)``, so it does not depend on its batch neighbours) and the exact
full-softmax log-prob of every sampled token at the sampling temperature (HF's scores come after its
logits processors). Temperature 0 is greedy. A row stops at a stop or EOS token (kept, like vLLM keeps it)
or after ``min(max_new_tokens, max_model_len - len(prompt))`` tokens.

Weights load in place into the parameters holding each checkpoint tensor (:func:`checkpoint_layout`:
transformers keeps an MoE layer's experts fused); a tied LM head stays tied. With ``routing_layers`` each
sample's routing record comes along (:mod:`megarlhf.rollout.engines.routing`).
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Iterable

import torch

from megarlhf.core.dtypes import torch_dtype
from megarlhf.rollout.engines.api import ENGINES, EngineConfig, EngineSpec, RolloutEngine, WeightBucket
from megarlhf.rollout.engines.routing import GateRecorder, unrouted
from megarlhf.rollout.engines.sampling import RolloutBatch, SamplingConfig, check_prompt_ids
from megarlhf.rollout.engines.weights import parameter_report

# logits of one prompt_logprobs chunk (rows x padded length x vocab) stay below this many elements
_LOGIT_BUDGET = 2**27
# finished rows are cut out of the KV cache once fewer than this share of the batch is still live:
# cutting copies the whole cache, so it is worth it only when a good part of it is dead
_COMPACT_BELOW = 0.75
_REASONS = ("length", "stop", "abort")  # the decode loop's per-row codes


def _ids(value) -> set[int]:
    """A config's ``eos_token_id`` (None, int or list) as a set."""
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def checkpoint_layout(model: torch.nn.Module) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Each tensor of the model's HF checkpoint (the names transformers saves) -> (the parameter holding it,
    element offset in that parameter, shape).

    transformers 5 keeps some checkpoint tensors fused or renamed in memory (an MoE layer's experts as one
    ``[experts, ...]`` parameter, Mixtral's ``block_sparse_moe`` as ``mlp``). Its own save-time conversion,
    applied to a parameter filled with its element indices, shows where each checkpoint tensor's elements
    sit; a parameter the conversion leaves as it is (found on the meta device, no indices) is its own
    tensor. A checkpoint tensor that is not one contiguous block of a parameter is refused.
    """
    from transformers.core_model_loading import revert_weight_conversion

    layout = {}
    for name, param in model.named_parameters():
        shapes = {n: tuple(t.shape) for n, t in revert_weight_conversion(
            model, {name: torch.empty(param.shape, device="meta")}).items()}
        if shapes == {name: tuple(param.shape)}:
            layout[name] = (name, 0, tuple(param.shape))
            continue
        index = torch.arange(param.numel(), dtype=torch.int64, device="cpu").view(param.shape)  # host: a probe
        for hf_name, part in revert_weight_conversion(model, {name: index}).items():
            flat = part.reshape(-1)
            start = int(flat[0])
            if not torch.equal(flat, torch.arange(start, start + flat.numel(), device="cpu")):  # host: the probe's
                raise ValueError(f"HF rollout engine: checkpoint tensor {hf_name} is not one contiguous block of "
                                 f"the model's parameter {name}")
            layout[hf_name] = (name, start, tuple(part.shape))
    return layout


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids from a left-padded attention mask: every row's first real token is at position 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


class HFEngine(RolloutEngine):
    """A rollout engine on an HF ``AutoModelForCausalLM`` (module docstring).

    ``max_batch_tokens`` bounds how many rows decode together (rows x (prompt + response) length); larger
    requests are split by prompts, which changes no sample since samples are batch-independent.
    """

    def __init__(self, hf_dir: str, *, dtype: torch.dtype, device: torch.device | str, seed: int,
                 max_model_len: int, max_batch_tokens: int = 2**18, routing_layers: tuple[int, ...] = ()):
        from transformers import AutoModelForCausalLM

        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise FileNotFoundError(f"HF rollout engine: {hf_dir} is not an HF model directory (no config.json)")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.layout = checkpoint_layout(self.model)
        config = self.model.config.get_text_config()
        self.vocab_size = int(config.vocab_size)
        limit = getattr(config, "max_position_embeddings", None)
        if max_model_len < 2 or (limit is not None and max_model_len > limit):
            raise ValueError(f"HF rollout engine: max_model_len={max_model_len} must be in [2, {limit}] "
                             f"(max_position_embeddings of {hf_dir})")
        self.max_model_len, self.max_batch_tokens = max_model_len, max_batch_tokens
        gen_config = getattr(self.model, "generation_config", None)
        self.eos_ids = _ids(config.eos_token_id) | _ids(getattr(gen_config, "eos_token_id", None))
        # what finished rows are fed; its value never matters since those positions are masked out
        self.pad_id = int(config.pad_token_id) if getattr(config, "pad_token_id", None) is not None else 0
        self.sleep_supported = self.device.type == "cuda"
        self._asleep = False
        self._seed_source = torch.Generator().manual_seed(seed)
        self.recorder = GateRecorder(self.model, tuple(routing_layers)) if routing_layers else None
        self._abort = threading.Event()
        self._params = dict(self.model.named_parameters())

    @classmethod
    def from_config(cls, hf_dir: str, config: EngineConfig, device: torch.device) -> "HFEngine":
        if config.tensor_parallel_size != 1:
            raise ValueError(f"rollout.backend={config.backend!r} runs one engine per rank: "
                             f"rollout.tensor_parallel_size must be 1, got {config.tensor_parallel_size}")
        engine = cls(hf_dir, dtype=torch_dtype(config.dtype), device=device, seed=config.seed,
                     max_model_len=config.max_model_len, routing_layers=config.routing_layers)
        engine.config = config
        return engine

    # ---- generation ---------------------------------------------------------------------------------
    def _check_prompts(self, prompts: list[list[int]], what: str = "rollout prompt") -> None:
        # like vLLM: a prompt must leave room for at least one generated token
        if self._asleep:
            raise RuntimeError("HF rollout engine is asleep: wake_up(['weights']) before using it")
        check_prompt_ids(prompts, self.vocab_size, self.max_model_len, what)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Samples ``sampling.n`` responses for each prompt (token ids)."""
        sampling.validate(len(prompts))
        self._check_prompts(prompts)
        self._abort.clear()
        if sampling.seed is None and sampling.prompt_seeds is None:
            base = int(torch.randint(0, 2**62, (), generator=self._seed_source))  # host: the engine's CPU generator
            sampling = dataclasses.replace(sampling, seed=base)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_ids)
        batch = RolloutBatch()
        if not prompts:
            return batch
        for first, chunk in self._chunks(prompts, sampling):
            seeds = [sampling.prompt_seed(i) + j for i in range(first, first + len(chunk)) for j in range(sampling.n)]
            if self._abort.is_set():  # aborted before this chunk started: nothing generated
                rows, routing = [([], [], "abort")] * len(seeds), []
            else:
                rows, routing = self._decode(chunk, seeds, sampling, stop_ids)
            for k, (ids, lps, reason) in enumerate(rows):
                i = first + k // sampling.n
                batch.prompt_index.append(i)
                batch.prompt_ids.append(list(map(int, prompts[i])))
                batch.response_ids.append(ids)
                batch.logprobs.append(lps)
                batch.finish_reasons.append(reason)
            batch.routed_experts += routing
        return batch

    def _chunks(self, prompts: list[list[int]], sampling: SamplingConfig):
        """Consecutive ``(first index, prompts)`` groups of at most ``max_batch_tokens`` decode tokens."""
        first, longest = 0, 0
        for i, p in enumerate(prompts):
            longest_with = max(longest, len(p))
            tokens = (i + 1 - first) * sampling.n * min(self.max_model_len, longest_with + sampling.max_new_tokens)
            if i > first and tokens > self.max_batch_tokens:
                yield first, prompts[first:i]
                first, longest_with = i, len(p)
            longest = longest_with
        yield first, prompts[first:]

    def _forward(self, ids, mask, positions, cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 logits of the last position of every row, extending ``cache``, and (when recording) the
        routing of every position, [rows, positions, moe_layers, top_k]."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        routing = self.recorder.take(*ids.shape) if self.recorder is not None else None
        return out.logits[:, -1].float(), routing

    @torch.inference_mode()
    def _decode(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingConfig, stop_ids: set[int]):
        """One batched decode loop over ``prompts`` x ``sampling.n`` rows (row r has seed ``seeds[r]``):
        ``(tokens, log-probs, finish reason)`` per row, and the rows' routing records (empty unless recording)."""
        if self.recorder is None:
            return self._decode_rows(prompts, seeds, sampling, stop_ids)
        self.recorder.active = True
        try:
            return self._decode_rows(prompts, seeds, sampling, stop_ids)
        finally:
            self.recorder.active = False

    def _prefill(self, prompts: list[list[int]], n: int, steps: int):
        """Left-padded prompts run once; their logits and KV cache repeated for the ``n`` samples of each.
        Returns (last logits, attention mask with room for ``steps`` tokens, cache, prompt routing)."""
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        # host: built on the host, then moved to the device in one copy each
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # host: as above
        mask = torch.zeros((len(prompts), width + steps), dtype=torch.long)  # host: as above
        for i, p in enumerate(prompts):  # left padding: every row's next token goes to column width + t
            ids[i, width - len(p):] = torch.tensor(list(map(int, p)))  # host: as above
            mask[i, width - len(p):width] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.model.config)
        logits, prompt_routing = self._forward(ids, mask[:, :width], _positions(mask[:, :width]), cache)
        cache.batch_repeat_interleave(n)
        return logits.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), cache, prompt_routing

    def _decode_rows(self, prompts, seeds, sampling, stop_ids):
        dev, n = self.device, sampling.n
        lens = torch.tensor([len(p) for p in prompts], device=dev).repeat_interleave(n)
        limits = (self.max_model_len - lens).clamp(max=sampling.max_new_tokens)
        width, steps, rows = int(lens.max()), int(limits.max()), len(seeds)
        logits, mask, cache, prompt_routing = self._prefill(prompts, n, steps)
        gens = None
        if sampling.temperature > 0:
            gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
        tokens = torch.full((rows, steps), self.pad_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=dev)
        length = torch.zeros(rows, dtype=torch.long, device=dev)
        reason = torch.zeros(rows, dtype=torch.long, device=dev)  # index into _REASONS
        live = torch.arange(rows, device=dev)  # the original row of each batch row
        routing = None if prompt_routing is None else torch.full((rows, steps, *prompt_routing.shape[2:]), -1,
                                                                  dtype=prompt_routing.dtype, device=dev)
        for t in range(steps):
            tok, lp = self._choose(logits, gens, sampling.temperature)
            tokens[live, t], logprobs[live, t] = tok, lp
            hit = torch.isin(tok, stop)
            going = (length[live] == 0) & ~hit & (t + 1 < limits[live])
            ended = (length[live] == 0) & ~going
            length[live[ended]] = t + 1
            reason[live[ended]] = hit[ended].long()  # 1: stop, 0: length
            if self._abort.is_set():  # the rows still going keep their tokens so far
                length[live[going]], reason[live[going]] = t + 1, 2
                break
            alive = int(going.sum())
            if alive == 0:
                break
            if alive < _COMPACT_BELOW * len(live):
                keep = going.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, tok, going, mask = live[keep], tok[keep], going[keep], mask[keep]
                if gens is not None:
                    gens = [gens[k] for k in keep.tolist()]
            mask[:, width + t] = going.long()
            step_ids = torch.where(going, tok, torch.full_like(tok, self.pad_id))[:, None]
            logits, step_routing = self._forward(step_ids, mask[:, :width + t + 1], (lens[live] + t)[:, None], cache)
            if routing is not None:  # the routing of the token fed: response token t
                routing[live, t] = step_routing[:, 0]
        tokens, logprobs = tokens.cpu().tolist(), logprobs.cpu().tolist()
        length, reason = length.cpu().tolist(), reason.cpu().tolist()
        results = [(tokens[r][:length[r]], logprobs[r][:length[r]], _REASONS[reason[r]]) for r in range(rows)]
        if routing is None:
            return results, []
        return results, self._records(prompts, prompt_routing.cpu(), routing.cpu(), length, n)

    @staticmethod
    def _records(prompts, prompt_routing, routing, length, n) -> list[torch.Tensor]:
        """Each row's routing record: its prompt's (the real, right-aligned columns of the left-padded
        prefill) then its generated tokens' (the last never fed: unrouted)."""
        width, records = prompt_routing.shape[1], []
        for r, count in enumerate(length):
            prompt = prompt_routing[r // n, width - len(prompts[r // n]):]
            fed = routing[r, :count - 1] if count > 0 else routing[r, :0]
            records.append(torch.cat([prompt, fed, unrouted(min(count, 1), *routing.shape[2:])]))
        return records

    @staticmethod
    def _choose(logits: torch.Tensor, gens: list[torch.Generator] | None,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token of every row and its log-prob at the sampling temperature."""
        if temperature == 0:
            tok = logits.argmax(dim=-1)
            return tok, logits.log_softmax(dim=-1).gather(-1, tok[:, None]).squeeze(-1)
        logprobs = (logits / temperature).log_softmax(dim=-1)
        probs = logprobs.exp()
        # argmax(p / E) with E ~ Exp(1) i.i.d. draws token i with probability p_i (the exponential race):
        # one vector of noise per row from that row's own generator, no multinomial. Noise is kept away
        # from 0, where p / E would be inf (or nan for a token of probability 0).
        noise = torch.empty_like(probs)
        for r, gen in enumerate(gens):
            noise[r].exponential_(generator=gen)
        tok = (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        return tok, logprobs.gather(-1, tok[:, None]).squeeze(-1)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of tokens 1..L-1 of each sequence given its prefix (teacher forcing, temperature 1)."""
        self._check_prompts(sequences, "sequence to score")
        return self.teacher_forced(sequences, 1.0)

    @torch.inference_mode()
    def teacher_forced(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """``log_softmax(logits / temperature)`` of tokens 1..L-1 of each sequence given its prefix, fp32,
        in chunks whose logits stay within a fixed number of elements."""
        result: list[list[float]] = []
        start = 0
        while start < len(sequences):
            end, longest = start, 0
            while end < len(sequences):
                longest_with = max(longest, len(sequences[end]))
                if end > start and (end + 1 - start) * longest_with * self.vocab_size > _LOGIT_BUDGET:
                    break
                end, longest = end + 1, longest_with
            result += self._teacher_forced(sequences[start:end], longest, temperature)
            start = end
        return result

    def _teacher_forced(self, sequences: list[list[int]], width: int, temperature: float) -> list[list[float]]:
        # right padding: causal attention keeps every real token from seeing the pads after it
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)  # host: moved in one copy below
        mask = torch.zeros((len(sequences), width), dtype=torch.long)  # host: as above
        for i, s in enumerate(sequences):
            ids[i, :len(s)] = torch.tensor(list(map(int, s)))  # host: as above
            mask[i, :len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=False).logits
        logits = logits[:, :-1].float()
        if temperature != 1.0:
            logits = logits / temperature
        lps = logits.log_softmax(dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu().tolist()
        return [row[:len(s) - 1] for row, s in zip(lps, sequences)]

    def abort(self) -> None:
        self._abort.set()

    # ---- weights and memory -------------------------------------------------------------------------
    def placement(self, hf_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int]]:
        """Each HF tensor's place in the engine, ``hf_name -> (parameter, element offset)``
        (:func:`checkpoint_layout`); for the trainer's prediction of the engine's fingerprints."""
        return {name: self.layout[name][:2] for name in hf_shapes if name in self.layout}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Copies each tensor into place as it arrives (nothing is kept), in one load session; the report of the
        parameters after."""
        self.begin_load()
        for name, tensor in weights:
            self._copy_in(name, tensor)
        return self.finish_load()

    def begin_load(self) -> None:
        """Nothing to prepare: tensors are copied in place as they arrive."""

    @torch.no_grad()
    def load_bucket(self, bucket: WeightBucket) -> None:
        for name, tensor in bucket.tensors():
            self._copy_in(name, tensor)

    def finish_load(self) -> dict:
        return parameter_report(self.model, None, self.model.dtype)

    def _copy_in(self, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor into the parameter holding it (converted to its dtype and device). A tied LM
        head has no parameter of its own (it is the embedding), so ``lm_head.weight`` is unknown there."""
        if name not in self.layout:
            tied = " (the model ties its LM head to the embedding)" if name == "lm_head.weight" else ""
            raise ValueError(f"HF rollout engine: load_weights got {name!r}, which is not a tensor of the "
                             f"model's checkpoint{tied}")
        param_name, offset, shape = self.layout[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"HF rollout engine: load_weights got {name!r} of shape {tuple(tensor.shape)}; "
                             f"the model's is {shape}")
        self._params[param_name].view(-1)[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))

    def checkpoint_report(self) -> dict:
        """The fingerprints of the parameters as loaded from the checkpoint (by transformers' own loader,
        at construction; nothing has been synced yet when the gates' calibration asks)."""
        return parameter_report(self.model, None, self.model.dtype)

    def sleep(self) -> None:
        """On CUDA: moves the weights to host memory and frees the device memory they held."""
        if self.sleep_supported:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self._asleep = True

    def wake_up(self, tags: list[str]) -> None:
        """Re-allocates the weights; the KV cache lives only inside ``generate``."""
        super().wake_up(tags)
        if self.sleep_supported and "weights" in tags:
            self.model.to(self.device)
            self._asleep = False


ENGINES.register("hf")(EngineSpec(build=HFEngine.from_config))
