"""Summarize the cost model's validation campaign (bench/experiments/cost_validation.sh): per
file and size, the planner's pick, its predicted / measured time and its measured time over the
fastest algorithm measured (``!`` outside 15% and 5%), then the counts.

    python bench/experiments/cost_validation_summary.py results/cost_model/validation
    python bench/experiments/cost_validation_summary.py --replan results/cost_model/validation

``--replan``: the pick and the prediction of today's :mod:`bitcoll.plan`, from the model and
the group each file names in its header, against the times the file measured: how a change
of the formulas fares on the stored measurements (fields a file's model does not name take
today's defaults). ``--set FIELD=VALUE`` (with ``--replan``, repeatable) overrides a field of
every file's model: how a change of a parameter fares::

    python bench/experiments/cost_validation_summary.py --replan --set switch_latency=2e-4 \
        results/cost_model/validation

``--fit FIELD[,FIELD...]`` (implies ``--replan``) searches those fields of every file's model
(one factor per field for all files, from 1/16 to 16 times the file's value, coordinate by
coordinate over a grid of factors, three passes) for the most predictions within 15%,
ties going to the smaller sum over every measured algorithm of ``min(|log(pred/meas)|,
log 2)``, prints the factors and summarizes with them. Fitted on one campaign, the factors
are to be judged on another.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bitcoll.plan import Call, CostModel, Group, choose, predict

_ROW = re.compile(r"^(?:\[rank 0\] )?(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*([*+-]*)")
_MODEL = re.compile(r"# model: CostModel\(([^)]*)\)")
_GROUP = re.compile(r"validation: (\w+), Group\(([^)]*)\)")


def _fields(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(", "))


def _replanner(text: str, overrides: dict[str, float]) -> tuple[str, CostModel, Group] | None:
    """The collective, model (with ``overrides``) and group a file's header names (None: no
    header)."""
    m, g = _MODEL.search(text), _GROUP.search(text)
    if m is None or g is None:
        return None
    known = set(CostModel.__dataclass_fields__)
    fields = {k: float(v) for k, v in _fields(m.group(1)).items() if k in known}
    model = CostModel.from_mapping({**fields, **overrides})
    gf = _fields(g.group(2))
    group = Group(int(gf["size"]), int(gf["hosts"]), int(gf["per_host"]),
                  float(gf["cores_per_rank"]), gf.get("two_level", "True") == "True",
                  gf.get("streams", "False") == "True")
    return g.group(1), model, group


def _load(folder: Path) -> list[tuple[str, str, dict[int, dict[str, tuple[float, float, str]]]]]:
    """(stem, text, {size: {algorithm: (measured, predicted, mark)}}) of every file."""
    files = []
    for path in sorted(folder.glob("h*.txt")):
        text = path.read_text()
        sizes: dict[int, dict[str, tuple[float, float, str]]] = {}
        for line in text.splitlines():
            m = _ROW.match(line.strip())
            if m:
                size, algo, meas, pred, _, mark = m.groups()
                sizes.setdefault(int(size), {})[algo] = (float(meas), float(pred), mark)
        files.append((path.stem, text, sizes))
    return files


def _call(collective: str, size: int, group: Group) -> Call:
    """The call of a row: ``size`` bytes of float32 input (each rank's for the all-gather,
    whose call is its output)."""
    if collective == "packed":
        return Call(count=size // 4)
    return Call(nbytes=size * (group.size if collective == "allgather" else 1))


def _scaled(model: CostModel, factors: dict[str, float]) -> CostModel:
    """``model`` with the fields ``factors`` names multiplied by them."""
    return model.replace(**{f: getattr(model, f) * k for f, k in factors.items()})


def _score(files: list[tuple[str, str, dict[int, dict[str, tuple[float, float, str]]]]],
           base: dict[str, float], factors: dict[str, float]) -> tuple[int, float]:
    """(picks predicted within 15%, sum of clipped |log(pred/meas)| over every algorithm)
    with the fields ``factors`` names multiplied by them (``base``: other overrides)."""
    within, err = 0, 0.0
    for _, text, sizes in files:
        plan = _replanner(text, base)
        if plan is None:
            continue
        collective, model, group = plan
        model = _scaled(model, factors)
        for size, algos in sizes.items():
            call = _call(collective, size, group)
            for algo, (meas, _, _) in algos.items():
                err += min(abs(math.log(predict(collective, algo, model, group, call) * 1e6
                                        / meas)), math.log(2))
            pick = choose(collective, model, group, call)
            if pick in algos:
                within += abs(predict(collective, pick, model, group, call) * 1e6
                              / algos[pick][0] - 1) <= 0.15
    return within, err


def _fit(files: list[tuple[str, str, dict[int, dict[str, tuple[float, float, str]]]]],
         base: dict[str, float], fields: list[str]) -> dict[str, float]:
    """Coordinate search of one factor per field (see the module docstring)."""
    grid = [2 ** (e / 4) for e in range(-16, 17)]
    factors = dict.fromkeys(fields, 1.0)
    best = _score(files, base, factors)
    for _ in range(3):
        for f in fields:
            for k in grid:
                trial = {**factors, f: k}
                got = _score(files, base, trial)
                if (got[0], -got[1]) > (best[0], -best[1]):
                    factors, best = trial, got
    return factors


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--replan", action="store_true",
                    help="pick and predict with today's planner instead of the file's marks")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="with --replan: override a field of every file's cost model")
    ap.add_argument("--fit", default="", metavar="FIELD[,FIELD...]",
                    help="fit one factor per field of every file's model (implies --replan)")
    args = ap.parse_args(argv)
    overrides: dict[str, float] = {}
    for item in args.set:
        field, _, value = item.partition("=")
        if field not in CostModel.__dataclass_fields__ or not value:
            ap.error(f"--set {item!r}: FIELD=VALUE with a field of CostModel")
        overrides[field] = float(value)
    fields = [f for f in args.fit.split(",") if f]
    for f in fields:
        if f not in CostModel.__dataclass_fields__:
            ap.error(f"--fit {f!r}: not a field of CostModel")
    if overrides and not (args.replan or fields):
        ap.error("--set needs --replan")
    files = _load(args.folder)
    factors: dict[str, float] = {}
    if fields:
        args.replan = True
        factors = _fit(files, overrides, fields)
        print("fitted factors: " + ", ".join(f"{f} x{k:.3g}" for f, k in factors.items()))
    within = good = total = 0
    for stem, text, sizes in files:
        plan = _replanner(text, overrides) if args.replan else None
        if args.replan and plan is None:
            print(f"{stem:24s} (no model or group in the header: skipped)")
            continue
        if plan is not None and factors:
            collective, model, group = plan
            plan = collective, _scaled(model, factors), group
        cells = []
        for size, algos in sorted(sizes.items()):
            if plan is not None:
                collective, model, group = plan
                call = _call(collective, size, group)
                pick = choose(collective, model, group, call)
                if pick not in algos:
                    continue
                meas = algos[pick][0]
                pred = predict(collective, pick, model, group, call) * 1e6
            else:
                picks = [a for a, (_, _, mark) in algos.items() if "*" in mark]
                if not picks:
                    continue
                pick = picks[0]
                meas, pred, _ = algos[pick]
            best = min(v[0] for v in algos.values())
            r, q = pred / meas, meas / best
            total += 1
            within += abs(r - 1) <= 0.15
            good += q <= 1.05
            cells.append(f"{size}:{pick[:4]} {r:.2f}{'!' if abs(r - 1) > 0.15 else ''}"
                         f"/{q:.2f}{'!' if q > 1.05 else ''}")
        print(f"{stem:24s} " + "  ".join(cells))
    print(f"predictions within 15%: {within}/{total}; pick within 5% of best: {good}/{total}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
