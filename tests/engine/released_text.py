"""Reference text of an output as Kiln's detokenizers release it (kiln/engine/byte_runs.py).

decode(prompt context + output) less the context's own text (from where they first differ: a
prompt may end inside a character the output completes), except that a byte-fallback run with
whole characters in the output before a bad byte (or an unfinished last character) is split
after those characters, and the rest decodes as a run of its own, behind an anchor token. The
full decode turns such a run into one U+FFFD a byte; the stream released the characters
before the bad byte when they completed and cannot take them back.
"""
import os

from kiln.engine.byte_runs import byte_token_values, cached_anchor, final_prefix, valid_prefix
from kiln.engine.detokenizer import INITIAL_CONTEXT_TOKENS, skipped_special_ids


def _split_points(tok, ids, num_context, skip):
    values = byte_token_values(tok)
    skipped = skipped_special_ids(tok) if skip else frozenset()
    cuts, run = [], []
    for j, tid in enumerate(ids + [None]):
        if tid in values:
            run.append(j)
            continue
        if tid is not None and tid in skipped:
            continue  # a skipped token vanishes before decoding: the runs around it join
        if run:
            in_prompt = [k for k in run if k < num_context]
            kept = final_prefix(bytes(values[ids[k]] for k in in_prompt))
            if in_prompt and len(in_prompt) < len(run) and kept:
                # the prompt's final bytes are its own: the output's part is a run of its own
                cuts.append(in_prompt[kept - 1] + 1)
                run = run[kept:]
            p, _ = valid_prefix(bytes(values[ids[k]] for k in run))
            if 0 < p < len(run) and run[p - 1] + 1 > num_context:
                cuts.append(run[p - 1] + 1)
            run = []
    return cuts


def released_text(tok, prompt, ids, skip):
    ctx = list(prompt[-INITIAL_CONTEXT_TOKENS:])
    all_ids = ctx + list(ids)
    anchor = cached_anchor(tok)
    cuts = _split_points(tok, all_ids, len(ctx), skip) if anchor else []
    first = all_ids[:cuts[0]] if cuts else all_ids
    joined = tok.decode(first, skip_special_tokens=skip)
    alone = tok.decode(ctx, skip_special_tokens=skip)
    text = joined[len(os.path.commonprefix([joined, alone])):]
    if cuts and cuts[0] <= len(ctx):
        text = ""  # a cut after the prompt's own characters: none of its text is the output's
    for a, b in zip(cuts, cuts[1:] + [len(all_ids)]):
        seg = _after(tok, all_ids, a, b, anchor, skip)
        if a < len(ctx):  # less what the prompt's part of the run gave (a partial character)
            seg = seg[len(os.path.commonprefix([seg, _after(tok, all_ids, a, len(ctx), anchor,
                                                            skip)])):]
        text += seg
    return text


def _after(tok, all_ids, a, b, anchor, skip):
    """The text of all_ids[a:b] where it follows all_ids[:a]."""
    if not tok.decode(all_ids[:a], skip_special_tokens=skip):
        return tok.decode(all_ids[a:b], skip_special_tokens=skip)  # the start: stripped
    anchored = tok.decode(anchor[0] + all_ids[a:b], skip_special_tokens=skip)
    assert anchored.startswith(anchor[1])
    return anchored[len(anchor[1]):]
