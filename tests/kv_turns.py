"""Conversations by hand for the tests of the KV kept across turns (generation/generator.py, "KV kept across
turns"): ``talk`` runs a few turns of ``Generator.generate`` over rows, each turn's responses followed by an
observation of a few fixed tokens, as rollout/multiturn.py does, with each row's KV kept from one turn to the
next (``keep=True``: the next turn prefills the new tokens only) or every turn's whole context prefilled again."""

import torch

from megatron_gspo.generation.generator import KeptRows

STRIDE = 1 << 20  # a row's noise key at turn t: key + t * STRIDE


def observation(row: int, turn: int) -> list[int]:
    """1 to 3 tokens, by row: rows get new suffixes of different lengths."""
    return [11 + turn, 12, 13][:1 + row % 3]


def talk(gen, model, prompts, cfg, keys, keep: bool, turns: int = 3, end_after=None):
    """(streams, log-probs per stream position, routes [L, n - 1, k] per row, tokens prefilled in all, outputs).
    ``end_after``: {row: turn}: the row ends after that turn (default: the last) (no observation; a rank may run out of rows and
    step on dummy rows). Every rank calls generate at every turn (the lockstep)."""
    from megatron_gspo.routing.rollout_routes import RolloutRecorder

    end_after = end_after or {}
    ctx = [list(p) for p in prompts]
    lps = [[0.0] * len(p) for p in prompts]
    routes = [None] * len(prompts)
    live, kept, prefilled, outs = list(range(len(prompts))), None, 0, []
    for turn in range(turns):
        rec = RolloutRecorder(model)
        try:
            with rec.recording():
                out = gen.generate([ctx[i] for i in live], cfg, row_keys=[keys[i] + turn * STRIDE for i in live],
                                   on_forward=rec.on_forward, keep_kv=keep, resume=kept)
            got = rec.finish(out).routes if live else None
        finally:
            rec.close()
        outs.append(out)
        prefilled += out.prefill_tokens
        for j, i in enumerate(live):
            p, n = int(out.prompt_lengths[j]), int(out.response_lengths[j])
            have = 0 if routes[i] is None else routes[i].shape[1]
            ctx[i] += out.tokens[j, p:p + n].tolist()
            lps[i] += out.logprobs[j, p:p + n].tolist()
            new = got[:, j, have:len(ctx[i]) - 1].long()  # the positions new to this turn, as multiturn._take
            routes[i] = new if routes[i] is None else torch.cat([routes[i], new], 1)
        going = [j for j, i in enumerate(live) if end_after.get(i, turns - 1) > turn]
        for j in going:
            obs = observation(live[j], turn)
            ctx[live[j]] += obs
            lps[live[j]] += [0.0] * len(obs)
        kept = out.kept.select(going) if keep and out.kept is not None and going else None
        live = [live[j] for j in going]
    gen.release_kv()
    return ctx, lps, routes, prefilled, outs
