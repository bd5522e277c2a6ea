"""A rollout engine on plain HF transformers + torch, with the contract of :class:`RolloutEngine`.

:class:`HFRolloutEngine` is the second, independent rollout backend: the RL loop can run where vLLM is
not installed, and vLLM's samples and log-probs can be cross-checked against it. It has the same
surface as the vLLM engine (``generate``, ``prompt_logprobs``, ``load_weights``, ``sleep``, ``wake_up``,
``sleep_supported``, ``vocab_size``) and returns the same :class:`RolloutBatch`:

* ``generate``: ``sampling.n`` samples per prompt, prompt-major, samples of a prompt in order. Sample
  ``j`` of prompt ``i`` draws its noise from its own ``torch.Generator`` seeded ``sampling.seed + i * n +
  j`` (``seed=None``: a base seed drawn from the engine's seed, one per call, so an engine instance is
  still deterministic), so a sample does not depend on what else is in the batch. Temperature 0 is
  greedy (argmax); otherwise a draw from ``softmax(logits / T)`` (no top-k / top-p: megarlhf refuses
  filtering, see :mod:`megarlhf.rollout.config`). A row stops at a stop
  token or an EOS token (config and generation-config ``eos_token_id``; not with ``ignore_eos``), which
  is kept in ``response_ids`` like vLLM keeps it ("stop"), or after ``min(max_new_tokens,
  max_model_len - len(prompt))`` tokens ("length"). A prompt must be shorter than ``max_model_len``.
* Reported log-probs are ``log_softmax(logits / T)[token]`` in fp32 over the whole vocabulary, T the
  sampling temperature (1 when greedy): what the trainer computes when it scores the response.
* ``prompt_logprobs``: teacher-forced ``log p(x_t | x_<t)``, t = 1..L-1, temperature 1, fp32.
* ``load_weights``: in-place copies of ``(hf_name, full tensor)`` pairs, named as the HF checkpoint names
  them, into the parameters holding them (:func:`checkpoint_layout`: transformers keeps an MoE layer's
  experts fused in one parameter); a tied LM head is not a parameter of its own and stays tied; returns
  the fingerprints of the parameters afterwards (the weight sync compares them with the trainer's, bit for
  bit, predicting each fused parameter from its parts with :meth:`HFRolloutEngine.placement`).
* ``sleep`` / ``wake_up``: on CUDA the weights go to host memory and back; nothing to do on CPU.
* With ``routing_layers`` (an MoE model's MoE layers, for routing replay) ``generate`` also returns each
  sample's routing record (:mod:`megarlhf.rollout.routing`): the prompt's from the prefill, each generated
  token's from the decode step that fed it.

Hand-written rather than ``model.generate``: the RL contract needs one seeded generator per sample
(HF's sampler draws from the global RNG for the whole batch, so a sample would depend on its batch
neighbours) and the exact full-softmax log-prob of every sampled token at the sampling temperature
(HF's scores come after its logits processors). The decode loop is batched: prompts are prefilled
once, their KV cache is repeated for the n samples, every step feeds all live rows together, and
finished rows are dropped from the cache once enough of them have accumulated.
"""
from __future__ import annotations

import dataclasses

import os
from typing import Iterable

import torch

from megarlhf.rollout.batch import RolloutBatch, check_prompt_ids
from megarlhf.rollout.config import SamplingConfig
from megarlhf.rollout.engine_weights import parameter_report
from megarlhf.rollout.routing import GateRecorder, unrouted

# logits of one prompt_logprobs chunk (rows x padded length x vocab) stay below this many elements
_LOGIT_BUDGET = 2**27
# finished rows are cut out of the KV cache once fewer than this share of the batch is still live:
# cutting copies the whole cache, so it is worth it only when a good part of it is dead
_COMPACT_BELOW = 0.75


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


class HFRolloutEngine:
    """A rollout engine on an HF ``AutoModelForCausalLM``: same contract as the vLLM ``RolloutEngine``
    (see the module docstring), with its own decode loop so that every sample has its own seeded
    generator and every sampled token its exact log-prob at the sampling temperature.

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

    # ---- generation ---------------------------------------------------------------------------------
    def _check_prompts(self, prompts: list[list[int]]) -> None:
        # like vLLM: a prompt must leave room for at least one generated token
        if self._asleep:
            raise RuntimeError("HF rollout engine is asleep: wake_up(['weights']) before using it")
        check_prompt_ids(prompts, self.vocab_size, self.max_model_len)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Samples ``sampling.n`` responses for each prompt (token ids)."""
        sampling.validate(len(prompts))
        self._check_prompts(prompts)
        if sampling.seed is None and sampling.prompt_seeds is None:
            base = int(torch.randint(0, 2**62, (), generator=self._seed_source))  # host: the engine's CPU generator
            sampling = dataclasses.replace(sampling, seed=base)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_ids)
        batch = RolloutBatch()
        if not prompts:
            return batch
        for first, chunk in self._chunks(prompts, sampling):
            seeds = [sampling.prompt_seed(i) + j for i in range(first, first + len(chunk)) for j in range(sampling.n)]
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

    def _decode_rows(self, prompts, seeds, sampling, stop_ids):
        from transformers import DynamicCache

        dev, n = self.device, sampling.n
        lens = torch.tensor([len(p) for p in prompts], device=dev).repeat_interleave(n)
        limits = (self.max_model_len - lens).clamp(max=sampling.max_new_tokens)
        width, steps, rows = int(lens.max()), int(limits.max()), len(seeds)
        # host: built on the host, then moved to the device in one copy each
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # host: as above
        mask = torch.zeros((len(prompts), width + steps), dtype=torch.long)  # host: as above
        for i, p in enumerate(prompts):  # left padding: every row's next token goes to column width + t
            ids[i, width - len(p):] = torch.tensor(list(map(int, p)))  # host: as above
            mask[i, width - len(p):width] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=self.model.config)
        # each prompt is prefilled once; its n samples share that prefix
        logits, prompt_routing = self._forward(ids, mask[:, :width], _positions(mask[:, :width]), cache)
        logits = logits.repeat_interleave(n, 0)
        cache.batch_repeat_interleave(n)
        mask = mask.repeat_interleave(n, 0)
        gens = None
        if sampling.temperature > 0:
            gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
        tokens = torch.full((rows, steps), self.pad_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=dev)
        length = torch.zeros(rows, dtype=torch.long, device=dev)
        stopped = torch.zeros(rows, dtype=torch.bool, device=dev)
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
            stopped[live[ended]] = hit[ended]
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
        length, stopped = length.cpu().tolist(), stopped.cpu().tolist()
        results = [(tokens[r][:length[r]], logprobs[r][:length[r]], "stop" if stopped[r] else "length")
                   for r in range(rows)]
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

    @torch.inference_mode()
    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of tokens 1..L-1 of each sequence given its prefix (teacher forcing, temperature 1)."""
        self._check_prompts(sequences)
        result: list[list[float]] = []
        start = 0
        while start < len(sequences):
            end, longest = start, 0
            while end < len(sequences):
                longest_with = max(longest, len(sequences[end]))
                if end > start and (end + 1 - start) * longest_with * self.vocab_size > _LOGIT_BUDGET:
                    break
                end, longest = end + 1, longest_with
            result += self._teacher_forced(sequences[start:end], longest)
            start = end
        return result

    def _teacher_forced(self, sequences: list[list[int]], width: int) -> list[list[float]]:
        # right padding: causal attention keeps every real token from seeing the pads after it
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)  # host: moved in one copy below
        mask = torch.zeros((len(sequences), width), dtype=torch.long)  # host: as above
        for i, s in enumerate(sequences):
            ids[i, :len(s)] = torch.tensor(list(map(int, s)))  # host: as above
            mask[i, :len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=False).logits
        lps = logits[:, :-1].float().log_softmax(dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu().tolist()
        return [row[:len(s) - 1] for row, s in zip(lps, sequences)]

    # ---- weights and memory -------------------------------------------------------------------------
    def fused_parameters(self) -> dict[str, list[str]]:
        """No module fuses differently named HF tensors (vLLM's ``qkv_proj``); fused experts are in
        :meth:`placement`."""
        return {}

    def placement(self, hf_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int]]:
        """Each HF tensor's place in the engine, ``hf_name -> (parameter, element offset)``
        (:func:`checkpoint_layout`); for the trainer's prediction of the engine's fingerprints."""
        return {name: self.layout[name][:2] for name in hf_shapes if name in self.layout}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Copies ``(hf_name, full tensor)`` pairs into the parameters holding those checkpoint tensors;
        returns the fingerprints of the parameters afterwards
        (:func:`~megarlhf.rollout.engine_weights.parameter_report`).

        A tied LM head has no parameter of its own (it is the embedding), so ``lm_head.weight`` is an
        unknown name there. Tensors are copied (converted to the engine's dtype and device), never kept.
        """
        params = dict(self.model.named_parameters())
        for name, tensor in weights:
            if name not in self.layout:
                tied = " (the model ties its LM head to the embedding)" if name == "lm_head.weight" else ""
                raise ValueError(f"HF rollout engine: load_weights got {name!r}, which is not a tensor of the "
                                 f"model's checkpoint{tied}")
            param_name, offset, shape = self.layout[name]
            if tuple(tensor.shape) != shape:
                raise ValueError(f"HF rollout engine: load_weights got {name!r} of shape {tuple(tensor.shape)}; "
                                 f"the model's is {shape}")
            params[param_name].view(-1)[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
        return parameter_report(self.model, None, self.model.dtype)

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
        """Re-allocates ``tags`` ("weights", "kv_cache"); the KV cache lives only inside ``generate``."""
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"HFRolloutEngine.wake_up: unknown tags {sorted(unknown)}")
        if self.sleep_supported and "weights" in tags:
            self.model.to(self.device)
            self._asleep = False
