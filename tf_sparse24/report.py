"""`report()`: the per-layer sparsity table of a model, pruned or not."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import numpy as np

from tf_sparse24.masks import is_nm_sparse, parse_pattern
from tf_sparse24.prune import check_model, pruned_layers
from tf_sparse24.registry import own_variables, scan_layer
from tf_sparse24.wrapper import Sparse24, walk_layers

__all__ = ["LayerReport", "format_report", "report"]


@dataclasses.dataclass
class LayerReport:
    """One row of `report()`."""

    layer: str
    kind: str
    status: str  # "pruned", "not pruned" (eligible, but not selected or not wrapped), "skipped"
    reason: str
    params: int  # elements of the pruned (or prunable-kind) weights
    nonzeros: int
    valid: bool | None  # effective weights are N:M and the layer uses them (None: not pruned)

    @property
    def density(self) -> float:
        return self.nonzeros / self.params if self.params else 1.0


def report(model: keras.Model, print_fn: Callable[[str], None] | None = print) -> list[LayerReport]:
    """Per-layer sparsity table: pruned, not pruned (eligible but left dense), or skipped (and
    why), with parameters, density and N:M validity.

    Layers without weights and layers of kinds that are never pruned (e.g. BatchNormalization)
    are left out. Pass `print_fn=None` to only return the rows.
    """
    check_model(model, "report")
    rows, claimed = [], set()  # a weight is reported once (MultiHeadAttention, not its sublayers)
    # Plain layers are judged against the model's group size ("4:8" skips a layer on 12 inputs).
    sizes = {parse_pattern(layer.pattern)[1] for layer in pruned_layers(model)}
    m = sizes.pop() if len(sizes) == 1 else 4
    for layer in walk_layers(model):
        if isinstance(layer, keras.Model):
            continue
        if isinstance(layer, Sparse24):
            effective = [(pw, layer.effective_weight(pw)) for pw in layer.pruned_weights]
            claimed |= {id(pw.variable) for pw in layer.pruned_weights}
            own_m = parse_pattern(layer.pattern)[1]
            left = _skip_reasons(layer.layer, own_m)
            rows.append(
                LayerReport(
                    layer=layer.name,
                    kind=type(layer.layer).__name__,
                    status="pruned",
                    reason=f"{layer.pattern}: " + ", ".join(pw.name for pw, _ in effective)
                    + "".join(f"; {r}" for r in left),
                    params=sum(int(np.prod(pw.variable.shape)) for pw, _ in effective),
                    nonzeros=sum(int(np.count_nonzero(w)) for _, w in effective),
                    valid=_masks_apply(layer)
                    and all(is_nm_sparse(w, pw.pattern, pw.axis) for pw, w in effective),
                )
            )
            inside = [layer.layer, *walk_layers(layer.layer)]  # what the wrapper left dense
            rows += [row for sub in inside if (row := _unpruned_row(sub, claimed, own_m))]
        elif row := _unpruned_row(layer, claimed, m):
            rows.append(row)
    if print_fn is not None:
        print_fn(format_report(rows))
    return rows


def _masks_apply(wrapper: Sparse24) -> bool:
    """False when the wrapped layer no longer uses `variable * mask` (Keras quantized it or
    enabled LoRA on it after pruning: the wrapper then refuses to run)."""
    try:
        wrapper.check_masks_apply()
    except ValueError:
        return False
    return True


def _skip_reasons(layer: keras.layers.Layer, m: int) -> list[str]:
    """Why weights under a wrapped `layer` were left out (an LSTM's kernel on 3 inputs, an RNN's
    unknown cell), each reason once: from the outermost layers the registry has anything to say
    about, not again from their sublayers."""
    reasons, covered = [], set()
    for sub in [layer, *walk_layers(layer)]:
        if id(sub) in covered:
            continue
        eligible, why = scan_layer(sub, m)
        if eligible or why:
            covered |= {id(s) for s in walk_layers(sub)}
            reasons += [r for r in why if r not in reasons]
    return reasons


def _unpruned_row(layer, claimed: set[int], m: int) -> LayerReport | None:
    """`report()`'s row for a plain layer: its eligible weights left dense, else the reasons it is
    skipped, else None. Weights already reported (`claimed`) are left out; a row claims all of the
    layer's weights, so MultiHeadAttention's sublayers do not repeat its row (a user's layer with
    a kernel of its own claims only that: the Dense layers it holds are reported as they are)."""
    if isinstance(layer, keras.Model) or not layer.weights:
        return None
    if all(id(v) in claimed for v in layer.weights):
        return None
    eligible, reasons = scan_layer(layer, m)
    dense = [(path, var) for path, var, _ in eligible if id(var) not in claimed]
    kind = type(layer).__name__
    if dense:
        detail = "eligible, left dense: " + ", ".join(path for path, _ in dense)
        row = LayerReport(layer.name, kind, "not pruned", "; ".join([detail, *reasons]),
                          sum(int(np.prod(v.shape)) for _, v in dense),
                          sum(int(np.count_nonzero(v)) for _, v in dense), None)
    elif reasons and not eligible:
        left = [v for v in layer.weights if v.ndim >= 2 and id(v) not in claimed]
        row = LayerReport(layer.name, kind, "skipped", "; ".join(reasons), *_counts(left), None)
    elif not type(layer).__module__.startswith("keras.") and (unknown := [
            v for v in own_variables(layer) if v.ndim >= 2 and id(v) not in claimed]):
        # A user's layer with a kernel of its own (`x @ self.w`): which axis it reduces over is
        # unknown, so it is left dense, and said so.
        paths = ", ".join(v.path.split("/")[-1] for v in unknown)
        row = LayerReport(
            layer.name, kind, "skipped",
            f"no rule for this layer's own weights ({paths}): to prune them, wrap it as "
            "tf_sparse24.Sparse24(layer, weights={path: reduction axis})", *_counts(unknown), None)
        claimed |= {id(v) for v in unknown}  # its sublayers' weights get their own rows
        return row
    else:
        return None
    claimed |= {id(v) for v in layer.weights}
    return row


def _counts(variables: list) -> tuple[int, int]:
    """`(params, nonzeros)` of `variables`."""
    return (sum(int(np.prod(v.shape)) for v in variables),
            sum(int(np.count_nonzero(v)) for v in variables))


def format_report(rows: list[LayerReport]) -> str:
    """Renders `report()` rows as an aligned text table with a total line."""
    header = ("layer", "type", "status", "params", "density", "N:M ok", "detail")
    lines = [
        (r.layer, r.kind, r.status, f"{r.params:,}", f"{r.density:.3f}",
         "-" if r.valid is None else ("yes" if r.valid else "NO"), r.reason)
        for r in rows
    ]
    pruned = [r for r in rows if r.status == "pruned"]
    total_params = sum(r.params for r in pruned)
    total_nnz = sum(r.nonzeros for r in pruned)
    lines.append(
        ("total pruned", "", f"{len(pruned)} layers", f"{total_params:,}",
         f"{total_nnz / total_params:.3f}" if total_params else "-",
         "yes" if all(r.valid for r in pruned) else "NO", "")
    )
    widths = [max(len(str(x[i])) for x in [header, *lines]) for i in range(len(header))]
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
    rule = "-" * len(fmt(header))
    return "\n".join([fmt(header), rule, *map(fmt, lines[:-1]), rule, fmt(lines[-1])])
