#!/usr/bin/env python3
"""Cross-validated recall quality, in process, with cambium_server's own scoring.

    python3 quality/cv.py [--dev ../shared/quality/dev] [--held quality/held]
                          [--folds 5] [--cache DIR]

What it does:
  1. loads each set's corpus through cambium's json import adapter and indexes
     it with cambium's own Index (lexical) and Embedder (semantic; vectors are
     cached on disk under --cache, keyed by model and text, so a rerun embeds
     nothing);
  2. on the dev queries, k-fold cross-validation (folds stratified by query
     kind, fixed seed): every free parameter is chosen on k-1 folds and scored
     on the fold left out; prints mean and spread (min..max) over the folds;
  3. the same selection on all dev queries gives the shipped parameters; the
     held-out set (never used to choose anything) is scored with them.

Parameters chosen this way (both modes): the relevance floor (the largest
whose false-abstention on the training folds stays <= --false-target) and, in
semantic mode, the BM25 blend weight, the discount of tail windows, whether an
item also gets a vector of its content + tags alone and of its why alone (and
their discounts), pseudo-relevance feedback (Rocchio weight, top 3 items) and
a raw-BM25 boost of relevance. What cambium_server ships is the choice this
script makes on all of dev (printed last for each mode).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import cambium_server as cs  # noqa: E402

LIMIT = 5


# --------------------------------------------------------------------------- data
def load_set(corpus: Path, queries: Path | None) -> tuple[list, list]:
    items = []
    for d in cs.json_adapter(corpus):
        if isinstance(d, cs.Draft):
            it = cs.new_item(d.content, kind=d.kind, why=d.why, tags=d.tags, source=d.source)
            items.append(it)
    qs = [json.loads(x) for x in queries.read_text().splitlines() if x.strip()] if queries else []
    return items, qs


class Vectors:
    """Embeddings of texts, cached on disk (one .npy per text hash)."""

    def __init__(self, cache: Path):
        self.dir = cache / hashlib.sha256(cs.MODEL_ID.encode()).hexdigest()[:12]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.emb = None
        import numpy as np
        self.np = np

    def _embedder(self):
        if self.emb is None:
            self.emb = cs.load_embedder()
        return self.emb

    def rows(self, text: str, whole: bool) -> "np.ndarray":
        """All windows of a text (whole) or its first window only."""
        key = hashlib.sha256(f"{whole}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()[:24]
        f = self.dir / f"{key}.npy"
        if f.exists():
            return self.np.load(f)
        emb = self._embedder()
        wins = emb.windows(text)
        out = emb.embed_ids(wins if whole else wins[:1])
        self.np.save(f, out)
        return out


def item_vector_rows(vec: Vectors, it) -> dict:
    """Candidate vectors of one item, by kind."""
    tags = " ".join(t for t in it.tags if t not in ("imported", str(it.source.get("system"))))
    out = {"full": vec.rows(cs.embed_text(it), True),
           "content_tags": vec.rows("\n".join(p for p in (it.content, tags) if p), False)}
    if it.why:
        out["why"] = vec.rows(it.why, False)
    return out


# --------------------------------------------------------------------------- features
class Prepared:
    """Per query: BM25 by slot, and per item the cosines of each vector kind."""

    def __init__(self, items, queries, vec: Vectors | None):
        self.items, self.queries = items, queries
        self.index = cs.build_index(items)
        ids = {it.source.get("ref"): n for n, it in enumerate(self.index.items)}
        self.gold = [{ids[g] for g in q["gold"]} for q in queries]
        self.lex = [cs.bm25_scores(self.index, list(dict.fromkeys(cs.tokenize(q["query"]))))
                    for q in queries]
        self.sims = None
        if vec is not None:
            np = vec.np
            kinds = [item_vector_rows(vec, it) for it in self.index.items]
            qv = np.concatenate([vec.rows(q["query"], False) for q in queries])
            self.first, self.qv = np.stack([k["full"][0] for k in kinds]), qv
            self.sims = {}
            for kind in ("full_first", "full_tail", "content_tags", "why"):
                mat = np.full((len(queries), len(kinds)), -np.inf, np.float32)
                for n, k in enumerate(kinds):
                    src = k["full"] if kind.startswith("full") else k.get(kind)
                    if kind == "full_first":
                        src = src[:1]
                    elif kind == "full_tail":
                        src = src[1:]
                    if src is not None and len(src):
                        mat[:, n] = (qv @ src.T).max(axis=1)
                self.sims[kind] = mat


def outcome(ranked: list[int], rel: list[float], gold: set, floor: float) -> tuple:
    """(rank of the gold item among the results or None, abstained)."""
    results = [s for s, r in zip(ranked, rel) if r >= floor]
    rank = next((n + 1 for n, s in enumerate(results) if s in gold), None)
    return rank, not results


def lexical_run(p: Prepared, qi: int, params: dict) -> tuple[list, list]:
    lex = p.lex[qi]
    top = cs.top_slots(lex, p.index.items, LIMIT)
    return top, [cs.lexical_relevance(lex[i], params["floor"]) for i in top]


def item_sims(p: Prepared, qi: int, params: dict):
    """Each item's similarity: the best of its vectors' cosines, discounted by kind."""
    np = cs_np()
    sim = np.maximum(p.sims["full_first"][qi], p.sims["full_tail"][qi] - params["tail"])
    for kind in ("content_tags", "why"):
        if params.get(kind) is not None:
            sim = np.maximum(sim, p.sims[kind][qi] - params[kind])
    return sim


def semantic_run(p: Prepared, qi: int, params: dict) -> tuple[list, list]:
    np = cs_np()
    sim = item_sims(p, qi, params)
    score, rel = cs.semantic_blend(np, sim, np.ones(len(sim), bool), p.lex[qi],
                                   weight=params["weight"], boost=params["boost"],
                                   floor=params["floor"])
    if params.get("prf"):                    # cambium's own Rocchio feedback
        score = cs.feedback_scores(np, p.first, p.qv[qi], sim, score, np.ones(len(sim), bool),
                                   beta=params["prf"])
    top = cs.best_slots(np, score, p.index.items, LIMIT)
    return top, [float(rel[i]) for i in top]


_NP = []


def cs_np():
    if not _NP:
        import numpy
        _NP.append(numpy)
    return _NP[0]


# --------------------------------------------------------------------------- metrics
def evaluate(p: Prepared, qids: list[int], run, params: dict) -> dict:
    rows = []
    for qi in qids:
        ranked, rel = run(p, qi, params)
        rank, abst = outcome(ranked, rel, p.gold[qi], cs.RELEVANCE_FLOOR)
        rows.append((p.queries[qi]["kind"], rank, abst))
    return metrics(rows)


def metrics(rows: list) -> dict:
    def part(kind):
        r = [x for x in rows if x[0] == kind]
        n = len(r) or 1
        return {"n": len(r), "hit@1": sum(x[1] == 1 for x in r) / n,
                "hit@5": sum(x[1] is not None for x in r) / n,
                "mrr": sum(1 / x[1] for x in r if x[1]) / n}
    ans = [x for x in rows if x[0] != "none"]
    none = [x for x in rows if x[0] == "none"]
    return {"control": part("control"), "paraphrase": part("paraphrase"),
            "abstention": sum(x[2] for x in none) / (len(none) or 1),
            "false_abstain": sum(x[2] for x in ans) / (len(ans) or 1),
            "n_none": len(none), "n_ans": len(ans)}


# --------------------------------------------------------------------------- selection
def confidences(p: Prepared, qids, run, params) -> list[float]:
    """Top relevance of each answerable query whose gold is ranked first (the
    floor must let those through)."""
    out = []
    for qi in qids:
        if p.queries[qi]["kind"] == "none":
            continue
        ranked, rel = run(p, qi, params)
        out.append(rel[0] if rel else 0.0)
    return out


def calibrate(p: Prepared, qids, run, params, false_target: float, key: str) -> float:
    """The highest raw floor (cosine or BM25) whose false-abstention on these
    answerable queries stays within the target."""
    probe = dict(params, floor=1e-9 if key == "floor" else params["floor"])
    raw = []
    for qi in qids:
        if p.queries[qi]["kind"] == "none":
            continue
        raw.append(raw_top(p, qi, run, probe))
    raw.sort()
    allowed = int(false_target * len(raw))          # queries we may wrongly abstain on
    return raw[allowed] * (1 - 1e-6) if raw else 0.0


def raw_top(p: Prepared, qi, run, params) -> float:
    if run is lexical_run:
        lex = p.lex[qi]
        return max(lex.values()) if lex else 0.0
    sim = item_sims(p, qi, params)
    ranked, _ = run(p, qi, params)
    lex = p.lex[qi]
    return max(float(sim[i]) + params["boost"] * lex.get(i, 0.0) for i in ranked)


def grid(mode: str) -> list[dict]:
    if mode == "lexical":
        return [{}]
    out = []
    for w in (0.0, 0.05, 0.1, 0.15, 0.2, 0.3):
        for tail in (0.0, 0.04, 0.08):
            for ct in (None, 0.0, 0.03):
                for why in (None, 0.0, 0.05):
                    for prf in (0.0, 0.3, 0.6):
                        out.append({"weight": w, "tail": tail, "content_tags": ct, "why": why,
                                    "prf": prf})
    return out


BOOSTS = (0.0, 0.004, 0.008, 0.012, 0.016, 0.02)


def select(p: Prepared, qids, mode: str, false_target: float) -> dict:
    """Ranking parameters by MRR on answerable training queries (ties: the
    simpler, earlier grid point), then the floor by calibration."""
    run = lexical_run if mode == "lexical" else semantic_run
    ans = [q for q in qids if p.queries[q]["kind"] != "none"]
    best, best_mrr = None, -1.0
    for params in grid(mode):
        params = dict(params, floor=1e-9, boost=0.0)
        m = evaluate(p, ans, run, params)
        mrr = (m["control"]["mrr"] * m["control"]["n"] + m["paraphrase"]["mrr"]
               * m["paraphrase"]["n"]) / max(1, m["control"]["n"] + m["paraphrase"]["n"])
        if mrr > best_mrr + 1e-9:
            best, best_mrr = params, mrr
    if mode == "lexical":
        best["floor"] = calibrate(p, qids, run, best, false_target, "floor")
        return best
    # the relevance's BM25 boost: the one whose calibrated floor catches most no-answers
    nones = [q for q in qids if p.queries[q]["kind"] == "none"]
    chosen, caught = best, -1.0
    for boost in BOOSTS:
        params = dict(best, boost=boost)
        params["floor"] = calibrate(p, qids, run, params, false_target, "floor")
        got = evaluate(p, nones, run, params)["abstention"]
        if got > caught + 1e-9:
            chosen, caught = params, got
    return chosen


def folds(queries: list, k: int, seed: int = 13) -> list[list[int]]:
    by_kind: dict[str, list[int]] = {}
    for n, q in enumerate(queries):
        by_kind.setdefault(q["kind"], []).append(n)
    rnd = random.Random(seed)
    out = [[] for _ in range(k)]
    for kind in sorted(by_kind):
        idx = by_kind[kind]
        rnd.shuffle(idx)
        for n, qi in enumerate(idx):
            out[n % k].append(qi)
    return out


def cross_validate(p: Prepared, mode: str, k: int, false_target: float):
    run = lexical_run if mode == "lexical" else semantic_run
    per_fold, chosen = [], []
    allq = list(range(len(p.queries)))
    for test in folds(p.queries, k):
        train = [q for q in allq if q not in set(test)]
        params = select(p, train, mode, false_target)
        chosen.append(params)
        per_fold.append(evaluate(p, test, run, params))
    # pooled counts over the k test folds (each query scored exactly once)
    return per_fold, chosen


def summary(per_fold: list[dict]) -> dict:
    def stat(get):
        vals = [get(m) for m in per_fold]
        return statistics.mean(vals), min(vals), max(vals)
    return {"control hit@1": stat(lambda m: m["control"]["hit@1"]),
            "paraphrase hit@1": stat(lambda m: m["paraphrase"]["hit@1"]),
            "paraphrase hit@5": stat(lambda m: m["paraphrase"]["hit@5"]),
            "no-answer abstained": stat(lambda m: m["abstention"]),
            "answerable wrongly abstained": stat(lambda m: m["false_abstain"])}


def fmt_single(m: dict) -> dict:
    return {"control hit@1": m["control"]["hit@1"], "paraphrase hit@1": m["paraphrase"]["hit@1"],
            "paraphrase hit@5": m["paraphrase"]["hit@5"], "no-answer abstained": m["abstention"],
            "answerable wrongly abstained": m["false_abstain"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    dev = next((up / "shared" / "quality" / "dev" for up in (ROOT.parent, ROOT.parent.parent)
                if (up / "shared" / "quality" / "dev").is_dir()),
               ROOT.parent / "shared" / "quality" / "dev")
    ap.add_argument("--dev", default=str(dev),
                    help="dev set folder (corpus.jsonl + queries.jsonl); default: "
                         "../shared/quality/dev beside the clone")
    ap.add_argument("--held", default=str(ROOT / "quality" / "held"))
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--false-target", type=float, default=0.03,
                    help="share of answerable training queries the floor may abstain on")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "cambium-cv"))
    ap.add_argument("--mode", choices=("lexical", "semantic", "both"), default="both")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    modes = ("lexical", "semantic") if a.mode == "both" else (a.mode,)
    vec = Vectors(Path(a.cache)) if "semantic" in modes else None
    dev = Prepared(*load_set(Path(a.dev) / "corpus.jsonl", Path(a.dev) / "queries.jsonl"), vec)
    held = Prepared(*load_set(Path(a.held) / "corpus.jsonl", Path(a.held) / "queries.jsonl"), vec)
    report = {}
    for mode in modes:
        run = lexical_run if mode == "lexical" else semantic_run
        per_fold, chosen = cross_validate(dev, mode, a.folds, a.false_target)
        final = select(dev, list(range(len(dev.queries))), mode, a.false_target)
        report[mode] = {"cv": summary(per_fold), "fold_params": chosen, "params": final,
                        "held": fmt_single(evaluate(held, list(range(len(held.queries))),
                                                    run, final))}
        print(f"\n== {mode}: {a.folds}-fold CV on dev ({len(dev.queries)} queries), "
              f"mean [min..max] over folds")
        for name, (mean, lo, hi) in report[mode]["cv"].items():
            print(f"  {name:<30}{mean:6.3f}  [{lo:.3f}..{hi:.3f}]")
        print(f"  params chosen per fold: {chosen}")
        print(f"== {mode}: held-out set ({len(held.queries)} queries), params from all dev: "
              f"{final}")
        for name, v in report[mode]["held"].items():
            print(f"  {name:<30}{v:6.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
