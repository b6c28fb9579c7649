"""Tensor-parallel inference on CPUs (docs/inference.md): a Llama-shaped model built from
a config with random weights (hidden 512, 8 layers, 8 heads, vocabulary 4096, bfloat16),
saved locally and loaded with transformers' `from_pretrained(..., tp_plan="auto")` under
torchrun; greedy decoding of 32 new tokens after a 32-token prompt under
`torch.inference_mode()`.

    # needs transformers (and deepspeed for the deepspeed setups), e.g. the integrations venv
    python benchmarks/tp_inference.py --rounds 3 --out benchmarks/results/tp_inference
    python benchmarks/tp_inference.py --setups pycomm-tp2,gloo-tp2 --rounds 1 --profile

Setups (--setups, comma separated): one-1t and one-2t (one process, 1 or 2 threads),
gloo-tp2 / pycomm-tp2 (and -tp4: more ranks than these 2 cores), deepspeed-tp2
(`deepspeed.init_inference` AutoTP over gloo: DeepSpeed's own shared-memory
`inference_all_reduce` where its CPU op builds and the CPU has the vector units its
dtype needs, torch's all_reduce otherwise) and deepspeed-pycomm-tp2 (the same over
pycomm). Every round runs every setup once, in the given order, each in fresh processes;
the report gives per setup the median over rounds and every round's figure, with the
load average before each run.

Per run (rank 0's clock, after one warm-up generation): prefill = one forward of the
prompt (with the cache); decode = 32 forwards of one token each on the cache, greedy;
generate = `model.generate(max_new_tokens=32, do_sample=False)` end to end. Each is the
median of --reps repetitions in the process. With --profile, rank 0 also profiles
--profile-steps decode steps (torch.profiler) and splits their time into collectives
(the c10d / DeepSpeed collective ops, waits included), compute (the self time of the
aten ops outside collectives) and the rest (Python: transformers' modules and TP
hooks, DTensor, generation); and, without the profiler, the time spent inside
torch.distributed.all_reduce calls during the timed decode.

That in-call time is split by arrival: every rank stamps each timed all-reduce call's
entry and exit on CLOCK_MONOTONIC (one clock for all processes of a Linux machine), the
ranks gather their stamps after the timed repetitions, and each rank's in-call time is
cut into waiting for the last rank to arrive (last entry - own entry) and the
collective's own time after the last arrival (own exit - last entry): no backend can
remove the first, which comes from the ranks' uneven compute and Python. Both are given
as shares of that rank's decode time and as the median microseconds per call. With
DeepSpeed the timed call is its `inference_all_reduce` (DeepSpeed's shared-memory op where
it runs, torch's all_reduce inside it otherwise), counted once.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SETUPS = {
    # name: (kind, ranks, threads per rank, backend)
    "one-1t": ("one", 1, 1, None),
    "one-2t": ("one", 1, 2, None),
    "gloo-tp2": ("tp", 2, 1, "gloo"),
    "pycomm-tp2": ("tp", 2, 1, "pycomm"),
    "deepspeed-tp2": ("deepspeed", 2, 1, "gloo"),
    "deepspeed-pycomm-tp2": ("deepspeed", 2, 1, "pycomm"),
    "gloo-tp4": ("tp", 4, 1, "gloo"),
    "pycomm-tp4": ("tp", 4, 1, "pycomm"),
}
DEFAULT_SETUPS = "one-1t,one-2t,gloo-tp2,pycomm-tp2,deepspeed-tp2,deepspeed-pycomm-tp2"

PROMPT_TOKENS = 32
NEW_TOKENS = 32


def make_model(path, seed=0):
    """The model of the issue: Llama-shaped, random weights, bfloat16, about 28M parameters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=512, intermediate_size=1280, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=4096, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- worker (one run)

COLLECTIVE_WORDS = ("tp_inference::all_reduce", "c10d::", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                    "inference_all_reduce", "c10d_functional", "wait_tensor", "pycomm:", "gloo:")


def _is_collective(name):
    low = name.lower()
    return any(w in low for w in COLLECTIVE_WORDS)


def _profile_split(events, wall_us):
    """Splits the profiled decode steps' wall time: collectives = the outermost collective
    events' inclusive time (main thread); compute = the self time of the other aten ops;
    rest = wall - both (Python and framework code between ops)."""
    main_tid = None
    by_thread = {}
    for e in events:
        by_thread.setdefault(e.thread, []).append(e)
    # the main thread is the one that ran the model: the most aten time
    main_tid = max(by_thread, key=lambda t: sum(e.cpu_time_total for e in by_thread[t]
                                               if e.name.startswith("aten::")))
    evs = sorted(by_thread[main_tid], key=lambda e: (e.time_range.start, -e.time_range.end))
    collective_us, compute_us, dtensor_us = 0.0, 0.0, 0.0
    open_collective_end = -1
    ops = {}
    for e in evs:
        start, end = e.time_range.start, e.time_range.end
        inside = start < open_collective_end
        if _is_collective(e.name):
            if not inside:
                collective_us += end - start
                open_collective_end = end
                ops[e.name] = ops.get(e.name, 0) + 1
            continue
        if inside:
            continue
        if e.name.startswith("aten::") or e.name.startswith("deepspeed::"):
            compute_us += e.self_cpu_time_total
        if "dtensor" in e.name.lower() or "redistribute" in e.name.lower():
            dtensor_us += e.self_cpu_time_total
    rest = max(0.0, wall_us - collective_us - compute_us)
    return {"wall_us": wall_us, "collective_us": collective_us, "compute_us": compute_us,
            "rest_us": rest, "dtensor_events_self_us": dtensor_us, "collective_ops": ops}


def arrival_split(entries, exits, tolerance=0):
    """Splits every rank's time inside a sequence of collective calls by arrival.

    entries[r][i] and exits[r][i]: when rank r entered and left its i-th call, on a clock
    shared by the ranks (the i-th calls of all ranks are one collective: the calls go to
    one group, in the same order on every rank). Per rank r and call i: wait = the last
    rank's entry - r's entry (>= 0, the time r waited for the others to arrive); own = r's
    exit - max(r's entry, last entry), the collective's own time after every rank had
    arrived; wait + own = exit - entry. last: whether r was (one of) the last to arrive.

    No rank can leave an all-reduce before the last rank entered it, so an exit earlier
    than the last entry by more than `tolerance` means the stamps do not share one clock
    (or the calls are not matched): ValueError, as for ranks with different numbers of
    calls or an exit before its own entry. An exit earlier by at most `tolerance` counts
    as own = 0. Returns [{"wait": [...], "own": [...], "last": [...]}, ...], one per rank,
    in the stamps' unit.
    """
    if len(entries) != len(exits) or not entries:
        raise ValueError(f"arrival_split: {len(entries)} ranks of entries, {len(exits)} of exits")
    counts = [(len(en), len(ex)) for en, ex in zip(entries, exits)]
    if len(set(counts)) != 1 or counts[0][0] != counts[0][1]:
        raise ValueError("arrival_split: the ranks made different numbers of calls (entries, exits per rank): "
                         + ", ".join(f"rank {r} {c}" for r, c in enumerate(counts)))
    out = [{"wait": [], "own": [], "last": []} for _ in entries]
    for i in range(counts[0][0]):
        last = max(en[i] for en in entries)
        for r, (en, ex) in enumerate(zip(entries, exits)):
            if ex[i] < en[i]:
                raise ValueError(f"arrival_split: rank {r} call {i} exits ({ex[i]}) before it enters ({en[i]})")
            own = ex[i] - max(en[i], last)
            if own < -tolerance:
                raise ValueError(
                    f"arrival_split: rank {r} left call {i} at {ex[i]}, before the last rank entered it at {last} "
                    f"(by {-own}): the ranks' stamps do not share one clock, or the calls are not matched")
            out[r]["wait"].append(last - en[i])
            out[r]["own"].append(max(own, 0))
            out[r]["last"].append(en[i] == last)
    return out


def split_summary(reps, tolerance_ns=0):
    """The arrival split of the timed decodes, per rank.

    reps: one item per timed repetition, each a list over ranks of (entries_ns,
    exits_ns, decode_s): the rank's all-reduce stamps (CLOCK_MONOTONIC nanoseconds) and
    its decode time in seconds. Per rank: the in-call, wait and own times as shares of
    that rank's decode time (median over the repetitions of each repetition's sum /
    decode), the median and mean per call in microseconds (over every call of every
    repetition; a few long waits make the mean much larger than the median), the calls per decode (per repetition), and the fraction of calls where the rank was (one of) the last to arrive.
    """
    ranks = len(reps[0])
    acc = [{"in_call": [], "wait": [], "own": [], "last": [], "shares": {"in_call": [], "wait": [], "own": []}}
           for _ in range(ranks)]
    for rep, per_rank in enumerate(reps):
        if len(per_rank) != ranks:
            raise ValueError(f"split_summary: repetition {rep} has {len(per_rank)} ranks, the first {ranks}")
        try:
            split = arrival_split([p[0] for p in per_rank], [p[1] for p in per_rank], tolerance_ns)
        except ValueError as e:
            raise ValueError(f"repetition {rep}: {e}") from None
        for r, (sp, (_, _, decode_s)) in enumerate(zip(split, per_rank)):
            in_call = [w + o for w, o in zip(sp["wait"], sp["own"])]
            for key, vals in (("in_call", in_call), ("wait", sp["wait"]), ("own", sp["own"])):
                acc[r][key] += vals
                acc[r]["shares"][key].append(sum(vals) / 1e9 / decode_s)
            acc[r]["last"] += sp["last"]
    rows = []
    for r, a in enumerate(acc):
        n = len(a["in_call"])
        row = {"rank": r, "calls_per_decode": n / len(reps)}
        for key in ("in_call", "wait", "own"):
            row[key + "_share_of_decode"] = statistics.median(a["shares"][key])
            row[key + "_us_median"] = statistics.median(a[key]) / 1e3 if n else None
            row[key + "_us_mean"] = statistics.fmean(a[key]) / 1e3 if n else None
        row["last_to_arrive"] = sum(a["last"]) / n if n else None
        rows.append(row)
    return rows


def worker(args):
    import torch

    kind, ranks, threads, backend = SETUPS[args.setup]
    torch.set_num_threads(threads)
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dist = None
    rank = 0
    if kind in ("tp", "deepspeed"):
        import torch.distributed as dist
        if backend == "pycomm":
            import pycomm  # noqa: F401  registers the backend
        if kind == "tp":
            dist.init_process_group(backend)
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, tp_plan="auto")
        else:
            import deepspeed
            deepspeed.init_distributed(dist_backend=backend)
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
            engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": ranks}, dtype=torch.bfloat16,
                                              replace_with_kernel_inject=False)
            model = engine.module
        rank = dist.get_rank()
        assert dist.get_world_size() == ranks, (dist.get_world_size(), ranks)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    model.eval()

    def sync():
        if dist is not None:
            dist.barrier()

    # all_reduce calls as the TP layers make them, timed without the profiler: each call's
    # entry and exit stamps on CLOCK_MONOTONIC, which every
    # process of the machine reads alike (the arrival split compares the ranks' stamps)
    ar_clock = {"on": False, "entries": [], "exits": [], "async": 0, "depth": 0}

    def timed(real):
        def timed_call(*a, **k):
            if ar_clock["depth"]:  # inside a timed call (DeepSpeed's falls back to torch's)
                return real(*a, **k)
            ar_clock["depth"] += 1
            try:
                if ar_clock.get("profiling"):
                    # the whole call, its wait included (gloo's op only enqueues the work)
                    with torch.profiler.record_function("tp_inference::all_reduce"):
                        return real(*a, **k)
                if not ar_clock["on"]:
                    return real(*a, **k)
                if k.get("async_op"):  # its exit is not its end: the split would be wrong
                    ar_clock["async"] += 1
                t = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                try:
                    return real(*a, **k)
                finally:
                    ar_clock["entries"].append(t)
                    ar_clock["exits"].append(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
            finally:
                ar_clock["depth"] -= 1
        return timed_call

    if dist is not None:
        dist.all_reduce = timed(dist.all_reduce)
        if kind == "deepspeed":
            import deepspeed.comm.comm as dscomm
            dscomm.cdb.inference_all_reduce = timed(dscomm.cdb.inference_all_reduce)

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_TOKENS), generator=g)
    out = {"setup": args.setup, "ranks": ranks, "threads": threads, "backend": backend,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "loadavg_start": os.getloadavg()}

    def decode(first_logits, cache, steps):
        tok = first_logits[:, -1:].argmax(-1)
        tokens = [tok]
        for _ in range(steps - 1):
            o = model(tok, past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            tok = o.logits[:, -1:].argmax(-1)
            tokens.append(tok)
        return torch.cat(tokens, 1)

    prefill_s, decode_s, generate_s, ar_s, ar_n, stamps = [], [], [], [], [], []
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)  # warm-up
        for _ in range(args.reps):
            sync()
            t0 = time.perf_counter()
            o = model(prompt, use_cache=True)
            t1 = time.perf_counter()
            ar_clock.update(on=True, entries=[], exits=[])
            # the first new token comes from the prefill; NEW_TOKENS decode forwards follow
            tokens = decode(o.logits, o.past_key_values, NEW_TOKENS + 1)
            t2 = time.perf_counter()
            ar_clock["on"] = False
            prefill_s.append(t1 - t0)
            decode_s.append(t2 - t1)
            ar_s.append(sum(b - a for a, b in zip(ar_clock["entries"], ar_clock["exits"])) / 1e9)
            ar_n.append(len(ar_clock["entries"]))
            stamps.append((ar_clock["entries"], ar_clock["exits"], t2 - t1))
            sync()
            t0 = time.perf_counter()
            gen = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            generate_s.append(time.perf_counter() - t0)
        out["tokens"] = gen[0, PROMPT_TOKENS:].tolist()
        out["decode_tokens"] = tokens[0, 1:].tolist()
        if dist is not None:
            out["allreduce_async_calls"] = ar_clock["async"]
            out["allreduce_split"] = gather_split(dist, stamps)
            r0 = out["allreduce_split"][0]
            out.update(allreduce_wait_share_of_decode=r0["wait_share_of_decode"],
                       allreduce_own_share_of_decode=r0["own_share_of_decode"],
                       allreduce_wait_us_median=r0["wait_us_median"], allreduce_own_us_median=r0["own_us_median"],
                       allreduce_us_median=r0["in_call_us_median"])

        if args.profile_steps:
            from torch.profiler import ProfilerActivity, profile
            o = model(prompt, use_cache=True)
            cache = o.past_key_values
            tok = o.logits[:, -1:].argmax(-1)
            for _ in range(2):  # steps outside the profile, so the profiled ones are warm
                o = model(tok, past_key_values=cache, use_cache=True)
                cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
            sync()
            ar_clock["profiling"] = True
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(args.profile_steps):
                    o = model(tok, past_key_values=cache, use_cache=True)
                    cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
                wall = time.perf_counter() - t0
            ar_clock["profiling"] = False
            split = _profile_split(prof.events(), wall * 1e6)
            split = {k: (v / args.profile_steps if isinstance(v, float) else v) for k, v in split.items()}
            split["collective_ops"] = {k: v // args.profile_steps for k, v in split["collective_ops"].items()}
            split["steps"] = args.profile_steps
            out["profile_per_step"] = split
            if args.trace and rank == 0:
                prof.export_chrome_trace(args.trace)

    out.update(prefill_ms=1e3 * statistics.median(prefill_s),
               decode_tokens_per_s=NEW_TOKENS / statistics.median(decode_s),
               decode_step_ms=1e3 * statistics.median(decode_s) / NEW_TOKENS,
               generate_tokens_per_s=NEW_TOKENS / statistics.median(generate_s),
               allreduce_calls_per_decode=statistics.median(ar_n) if dist else 0,
               allreduce_share_of_decode=statistics.median(a / d for a, d in zip(ar_s, decode_s)) if dist else 0.0,
               reps=args.reps, loadavg_end=os.getloadavg())
    if dist is not None:
        sync()
        if kind == "tp" or backend == "pycomm":
            out["process_group"] = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
        if kind == "deepspeed":
            import deepspeed.comm.comm as dscomm
            ds = dscomm.cdb
            op = getattr(ds, "shm_comm_op", None)
            out["deepspeed_shm_op"] = op is not None
            out["deepspeed_shm_vector_level"] = getattr(ds, "shm_vector_kernel_level", None)
        dist.destroy_process_group()
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(out, f)


def gather_split(dist, stamps):
    """Gathers every rank's stamps of the timed all-reduces over the default group and
    returns split_summary's rows (every rank gets all of them). stamps: per repetition,
    (entries_ns, exits_ns, decode_s) of this rank. Every rank makes the same calls; if
    the numbers of calls differ, every rank raises (after the same gathers, so none
    hangs)."""
    import torch

    world = dist.get_world_size()
    counts = torch.tensor([len(en) for en, _, _ in stamps], dtype=torch.int64)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    per_rank = [c.tolist() for c in all_counts]
    if any(c != per_rank[0] for c in per_rank):
        raise RuntimeError("tp_inference: the ranks made different numbers of timed all-reduce calls per "
                           "repetition: " + ", ".join(f"rank {r} {c}" for r, c in enumerate(per_rank)))
    flat = torch.tensor([t for en, ex, _ in stamps for t in en + ex], dtype=torch.int64)
    decode = torch.tensor([d for _, _, d in stamps], dtype=torch.float64)
    all_flat = [torch.empty_like(flat) for _ in range(world)]
    all_decode = [torch.empty_like(decode) for _ in range(world)]
    if flat.numel():  # the same on every rank: the counts are equal
        dist.all_gather(all_flat, flat)
    dist.all_gather(all_decode, decode)
    reps = []
    for rep, n in enumerate(per_rank[0]):
        start = 2 * sum(per_rank[0][:rep])
        reps.append([(f[start:start + n].tolist(), f[start + n:start + 2 * n].tolist(), d[rep].item())
                     for f, d in zip(all_flat, all_decode)])
    # an exit up to 1 us before the last entry is read-order noise of the two clock reads
    return split_summary(reps, tolerance_ns=1000)


# ---------------------------------------------------------------- driver

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(setup, model_dir, json_path, reps, profile_steps, trace, timeout_s):
    kind, ranks, threads, backend = SETUPS[setup]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    me = [os.path.abspath(__file__), "--worker", "--setup", setup, "--model", model_dir, "--json", json_path,
          "--reps", str(reps), "--profile-steps", str(profile_steps)] + (["--trace", trace] if trace else [])
    if ranks == 1:
        argv = [sys.executable] + me
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] + me
        env.setdefault("MASTER_PORT", str(free_port()))
    load = os.getloadavg()
    t = time.monotonic()
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s, start_new_session=True)
    if proc.returncode != 0 or not os.path.exists(json_path):
        return {"setup": setup, "error": proc.stdout[-3000:], "loadavg_before": load}
    with open(json_path) as f:
        res = json.load(f)
    res["loadavg_before"] = load
    res["run_s"] = time.monotonic() - t
    return res


# rank 0's arrival split, per run (the worker's JSON) and per setup (summarize)
SPLIT_KEYS = ("allreduce_wait_share_of_decode", "allreduce_own_share_of_decode", "allreduce_wait_us_median",
              "allreduce_own_us_median", "allreduce_us_median")
# each rank's (split_summary's rows)
SPLIT_ROW_KEYS = ("calls_per_decode", "in_call_share_of_decode", "wait_share_of_decode", "own_share_of_decode",
                  "in_call_us_median", "wait_us_median", "own_us_median", "in_call_us_mean", "wait_us_mean",
                  "own_us_mean", "last_to_arrive")


def summarize(results, setups):
    rows = []
    for s in setups:
        runs = [r for r in results if r["setup"] == s and "error" not in r]
        if not runs:
            errors = [r["error"][-300:] for r in results if r["setup"] == s and "error" in r]
            rows.append({"setup": s, "runs": 0, "error": errors[-1] if errors else "not run"})
            continue
        row = {"setup": s, "runs": len(runs)}
        for key in ("decode_tokens_per_s", "generate_tokens_per_s", "prefill_ms", "decode_step_ms",
                    "allreduce_share_of_decode") + SPLIT_KEYS:
            vals = [r[key] for r in runs if r.get(key) is not None]
            if not vals:
                continue
            row[key] = statistics.median(vals)
            row[key + "_all"] = vals
        split = [r["allreduce_split"] for r in runs if r.get("allreduce_split")]
        if split:
            # per rank, the median over rounds of each of split_summary's figures
            row["allreduce_split"] = [
                {"rank": rank, **{k: statistics.median(v) if v else None for k, v in (
                    (k, [s[rank][k] for s in split if s[rank][k] is not None]) for k in SPLIT_ROW_KEYS)}}
                for rank in range(len(split[0]))]
        row["loadavg_1min"] = [r["loadavg_before"][0] for r in runs]
        prof = [r["profile_per_step"] for r in runs if "profile_per_step" in r]
        if prof:
            row["profile_per_step"] = {k: statistics.median(p[k] for p in prof)
                                       for k in ("wall_us", "collective_us", "compute_us", "rest_us")}
            row["profile_per_step"]["collective_ops"] = prof[-1]["collective_ops"]
        for key in ("process_group", "deepspeed_shm_op", "deepspeed_shm_vector_level", "allreduce_calls_per_decode"):
            if key in runs[-1]:
                row[key] = runs[-1][key]
        rows.append(row)
    return rows


def markdown(rows, meta):
    base = {r["setup"]: r for r in rows if r.get("runs")}
    ref1 = base.get("one-1t", {}).get("decode_tokens_per_s")
    refg = base.get("gloo-tp2", {}).get("decode_tokens_per_s")
    lines = [f"# Tensor-parallel inference on CPUs: {meta['model']}", "",
             f"{meta['rounds']} rounds, setups interleaved, each run in fresh processes; medians over rounds "
             f"(each run's figure is the median of {meta['reps']} repetitions). Command: `{meta['command']}`. "
             f"{meta['cpus']} CPUs; torch {meta.get('torch', '?')}, transformers {meta.get('transformers', '?')}.", "",
             "| setup | decode tok/s (median) | per round | x one-1t | x gloo-tp2 | prefill ms | "
             "generate tok/s | all_reduce share of decode | of which waiting for the last rank | "
             "of which the collective after the last arrival | load (1 min) per round |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def share_us(r, share, us):
        if r.get(share) is None:
            return ""
        return f"{100 * r[share]:.1f}% ({r[us]:.0f} us/call)" if r.get(us) is not None else f"{100 * r[share]:.1f}%"

    for r in rows:
        if not r.get("runs"):
            lines.append(f"| {r['setup']} | failed: {r['error'][-120:]!r} | | | | | | | | | |".replace("\n", " "))
            continue
        d = r["decode_tokens_per_s"]
        x1 = f"{d / ref1:.2f}" if ref1 else ""
        xg = f"{d / refg:.2f}" if refg else ""
        lines.append(
            f"| {r['setup']} | {d:.1f} | {', '.join(f'{v:.1f}' for v in r['decode_tokens_per_s_all'])} | {x1} | {xg} | "
            f"{r['prefill_ms']:.1f} | {r['generate_tokens_per_s']:.1f} | {100 * r['allreduce_share_of_decode']:.0f}% | "
            f"{share_us(r, 'allreduce_wait_share_of_decode', 'allreduce_wait_us_median')} | "
            f"{share_us(r, 'allreduce_own_share_of_decode', 'allreduce_own_us_median')} | "
            f"{', '.join(f'{v:.1f}' for v in r['loadavg_1min'])} |")
    splits = [r for r in rows if r.get("allreduce_split")]
    if splits:
        lines += ["", "Time inside the timed decode's all-reduce calls, per rank, split by arrival (entry and exit "
                  "stamps on CLOCK_MONOTONIC, shared by the ranks): waiting = from the rank's entry to the last "
                  "rank's entry, which no backend removes; collective = from the last rank's entry to the rank's "
                  "exit. Shares of that rank's decode time (all the decode's calls) and microseconds per call, median (mean) over "
                  "the calls, medians over rounds:",
                  "",
                  f"| setup | rank | calls per decode ({NEW_TOKENS} tokens) | in all_reduce | waiting for the last rank | "
                  "collective after the last arrival | in all_reduce us/call | waiting us/call | collective us/call | "
                  "arrived last |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

        def pct(v):
            return "" if v is None else f"{100 * v:.1f}%"

        def us(s, key):
            med, mean = s[key + "_us_median"], s[key + "_us_mean"]
            return "" if med is None else f"{med:.0f} ({mean:.0f})"

        for r in splits:
            for s in r["allreduce_split"]:
                calls = "" if s["calls_per_decode"] is None else f"{s['calls_per_decode']:g}"
                lines.append(f"| {r['setup']} | {s['rank']} | {calls} | {pct(s['in_call_share_of_decode'])} | "
                             f"{pct(s['wait_share_of_decode'])} | {pct(s['own_share_of_decode'])} | "
                             f"{us(s, 'in_call')} | {us(s, 'wait')} | {us(s, 'own')} | "
                             f"{pct(s['last_to_arrive'])} |")
    profs = [r for r in rows if r.get("profile_per_step")]
    if profs:
        lines += ["", "Profile of a decode step (torch.profiler, rank 0, median over rounds; the profiler "
                  "slows small ops, so read the shares, not the totals):", "",
                  "| setup | step us | collectives | compute (aten self) | rest (Python, hooks, DTensor) | collective ops per step |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for r in profs:
            p = r["profile_per_step"]
            w = p["wall_us"]
            ops = ", ".join(f"{k} x{v}" for k, v in sorted(p["collective_ops"].items()))
            lines.append(f"| {r['setup']} | {w:.0f} | {p['collective_us']:.0f} ({100 * p['collective_us'] / w:.0f}%) | "
                         f"{p['compute_us']:.0f} ({100 * p['compute_us'] / w:.0f}%) | "
                         f"{p['rest_us']:.0f} ({100 * p['rest_us'] / w:.0f}%) | {ops} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setup", default="one-1t")
    ap.add_argument("--json")
    ap.add_argument("--trace")
    ap.add_argument("--model", help="model folder (default: made in a temporary folder)")
    ap.add_argument("--setups", default=DEFAULT_SETUPS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="profile decode steps in every run")
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    for s in setups:
        if s not in SETUPS:
            ap.error(f"unknown setup {s!r}; known: {', '.join(SETUPS)}")
    profile_steps = args.profile_steps or (8 if args.profile else 0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or os.path.join(tmp, "llama-512x8")
        if not os.path.exists(os.path.join(model_dir, "config.json")):
            n = make_model(model_dir)
            print(f"model: {n / 1e6:.1f}M parameters in {model_dir}", flush=True)
        results = []
        for rnd in range(args.rounds):
            for s in setups:
                res = launch(s, model_dir, os.path.join(tmp, f"{s}-{rnd}.json"), args.reps, profile_steps,
                             None, args.timeout)
                res["round"] = rnd
                results.append(res)
                if "error" in res:
                    print(f"round {rnd} {s}: FAILED\n{res['error'][-1500:]}", flush=True)
                else:
                    print(f"round {rnd} {s}: decode {res['decode_tokens_per_s']:.1f} tok/s, prefill "
                          f"{res['prefill_ms']:.1f} ms, generate {res['generate_tokens_per_s']:.1f} tok/s, "
                          f"all_reduce {100 * res['allreduce_share_of_decode']:.0f}% of decode"
                          + (f" (waiting for the last rank {100 * res['allreduce_wait_share_of_decode']:.1f}%, "
                             f"{res['allreduce_wait_us_median']:.0f} us/call; collective after it "
                             f"{100 * res['allreduce_own_share_of_decode']:.1f}%, "
                             f"{res['allreduce_own_us_median']:.0f} us/call)"
                             if res.get("allreduce_wait_us_median") is not None else "") + ", "
                          f"load {res['loadavg_before'][0]:.1f}", flush=True)
    import torch
    import transformers
    # every setup decodes the same tokens (greedy, same weights), in bfloat16 up to rounding
    # differences of the TP sums; report where they differ from one-1t
    ref = next((r.get("tokens") for r in results if r["setup"] == "one-1t" and "tokens" in r), None)
    meta = {"model": "Llama-shaped, hidden 512, 8 layers, 8 heads, vocab 4096, intermediate 1280, bfloat16",
            "rounds": args.rounds, "reps": args.reps, "cpus": os.cpu_count(), "command": " ".join(sys.argv),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
            "same_tokens_as_one_1t": {r["setup"]: r.get("tokens") == ref for r in results if "tokens" in r}
            if ref else {}}
    rows = summarize(results, setups)
    md = markdown(rows, meta)
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "summary": rows, "runs": results}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
