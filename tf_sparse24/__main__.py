"""Command line: prune or export a `.keras` model, inspect or verify an export.

    python -m tf_sparse24 prune MODEL.keras PRUNED.keras [--pattern N:M] [--permute]
                                [--layers NAME]... [--skip NAME]... [--overwrite]
                                [--import MODULE]...
    python -m tf_sparse24 export MODEL.keras models/name/1 [--mode portable|accelerated]
                                 [--overwrite] [--input NAME:DTYPE:SHAPE]... [--dict-inputs]
                                 [--import MODULE]...
    python -m tf_sparse24 inspect models/name/1 [--json]
    python -m tf_sparse24 verify models/name/1 [--against MODEL.keras] [--import MODULE]...

Also installed as the `tf_sparse24` console script. Exit status: 0 on success, 1 on a failed
export or check (the message names the layer, tensor or file), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tf_sparse24", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prune", help="one-shot prune a trained .keras model and print its report")
    p.add_argument("model", help="the trained .keras file")
    p.add_argument("output", help="the pruned .keras file to write, ready to fine-tune")
    p.add_argument("--pattern", default=None, help='"N:M", keep N of every M (default 2:4)')
    p.add_argument("--permute", action="store_true",
                   help="reorder channels first so the masks keep more magnitude (Functional "
                   "and Sequential models)")
    p.add_argument("--layers", action="append", metavar="NAME",
                   help="prune only this layer (repeat for several)")
    p.add_argument("--skip", action="append", metavar="NAME",
                   help="never prune this layer (repeat for several)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    _add_import(p)
    p = sub.add_parser("export", help="export a pruned .keras model as a compressed SavedModel")
    p.add_argument("model", help="the .keras file (pruned or stripped)")
    p.add_argument("export_dir", help="the version directory to write, e.g. models/name/1")
    p.add_argument("--mode", choices=("portable", "accelerated"), default="portable")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export_dir")
    p.add_argument(
        "--input", action="append", type=_input_spec, metavar="NAME:DTYPE:SHAPE",
        help="a served input, e.g. pixels:float32:None,28,28,1 (repeat --input for several; "
        "needed for subclassed models, which have no symbolic inputs)",
    )
    p.add_argument(
        "--dict-inputs", action="store_true",
        help="call the model with a dict of the --input tensors keyed by their names (a "
        "subclassed model whose call takes a dict)",
    )
    _add_import(p)
    p = sub.add_parser("inspect", help="print an export's metadata, per-weight table and sizes")
    p.add_argument("export_dir")
    p.add_argument("--json", action="store_true", help="print the raw metadata JSON instead")
    p = sub.add_parser("verify", help="check checksums, 2:4 validity, ops and (optionally) outputs")
    p.add_argument("export_dir")
    p.add_argument("--against", help="a .keras model whose outputs the export must match")
    _add_import(p)
    return parser


def _add_import(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--import", dest="modules", action="append", default=[], metavar="MODULE",
        help="import this module first, so that the custom classes the .keras file names are "
        "registered (repeat for several)",
    )


def _input_spec(text: str):
    """`NAME:DTYPE:SHAPE` (`x:float32:None,16`) -> a named `tf.TensorSpec`."""
    fields = text.split(":")
    name, dtype, shape = fields if len(fields) == 3 else ("", "", "")
    try:
        dims = [None if d.strip() in ("None", "-1", "") else int(d) for d in shape.split(",")]
    except ValueError:
        dims = None
    if not name or not dtype or not shape or dims is None or any(d < 0 for d in dims if d):
        raise argparse.ArgumentTypeError(
            "expected NAME:DTYPE:SHAPE such as x:float32:None,16 (dimensions: sizes >= 0, or "
            f"None for any). Received: {text!r}"
        )
    from tf_sparse24.signature import SIGNATURE_NAME_RULE, is_signature_name  # noqa: PLC0415

    if not is_signature_name(name):
        raise argparse.ArgumentTypeError(
            f"input name {name!r} in {text!r}: {SIGNATURE_NAME_RULE}")
    import tensorflow as tf  # noqa: PLC0415  (heavy; only when the option is used)

    try:
        return tf.TensorSpec(dims, tf.as_dtype(dtype), name=name)
    except TypeError as e:
        raise argparse.ArgumentTypeError(f"unknown dtype {dtype!r} in {text!r}") from e


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "dict_inputs", False) and not args.input:
        parser.error("--dict-inputs needs the inputs: --input NAME:DTYPE:SHAPE")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up noise out
    import keras  # noqa: PLC0415  (heavy imports after argument parsing)

    import tf_sparse24  # noqa: F401, PLC0415  (registers the Sparse24 wrapper for load_model)
    from tf_sparse24 import metadata as md  # noqa: PLC0415
    from tf_sparse24.atomic_dir import check_replaceable  # noqa: PLC0415
    from tf_sparse24.export import export  # noqa: PLC0415
    from tf_sparse24.verify import describe, verify  # noqa: PLC0415

    try:
        modules = getattr(args, "modules", [])  # inspect has no --import
        if modules:
            sys.path.insert(0, os.getcwd())  # as `python -m` has it; the console script does not
        for module in modules:
            importlib.import_module(module)
        if args.command == "prune":
            _prune(args)
        elif args.command == "export":
            if os.path.lexists(args.export_dir) and not args.overwrite:  # before loading the model
                raise FileExistsError(f"{args.export_dir} exists; pass --overwrite to replace it")
            check_replaceable(os.path.abspath(args.export_dir))
            model = keras.saving.load_model(args.model, compile=False)
            signature = {s.name: s for s in args.input} if args.dict_inputs else args.input
            metadata = export(model, args.export_dir, args.mode, args.overwrite, signature)
            print(f"exported {len(metadata['sparse'])} compressed weights to {args.export_dir}")
            print(describe(args.export_dir))
        elif args.command == "inspect":
            if args.json:
                print(md.dumps(md.read(args.export_dir)), end="")
            else:
                print(describe(args.export_dir))
        else:
            report = verify(args.export_dir, against=args.against)
            print(json.dumps(report, indent=1))
            print(f"OK: {args.export_dir}")
    except Exception as e:  # noqa: BLE001  (load_model's TypeError for a class not importable, ...)
        # ExportError is a ValueError; other kinds of error are named.
        kind = "" if isinstance(e, (ValueError, OSError, ImportError)) else f"{type(e).__name__}: "
        text = " ".join(str(e).split())  # one line (Keras' messages span several)
        print(f"tf_sparse24 {args.command}: error: {kind}{text}{_hint(args, e)}", file=sys.stderr)
        return 1
    return 0


def _prune(args: argparse.Namespace) -> None:
    """`prune`: loads the model, optionally permutes it, prunes it, prints the report and saves
    the pruned model atomically (written beside the output, then renamed over it)."""
    import keras  # noqa: PLC0415

    import tf_sparse24  # noqa: PLC0415
    from tf_sparse24.atomic_dir import sync_tree  # noqa: PLC0415

    if not args.output.endswith(".keras"):
        raise ValueError(f"the output must be a .keras file. Received: {args.output!r}")
    # All before loading the model. A link is an output too, also one to nothing (lexists).
    if os.path.isdir(args.output):
        raise IsADirectoryError(f"{args.output} is a directory; the output is a .keras file")
    if os.path.lexists(args.output) and not args.overwrite:
        raise FileExistsError(f"{args.output} exists; pass --overwrite to replace it")
    directory, name = os.path.split(os.path.abspath(args.output))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the directory {directory} of the output does not exist")
    model = keras.saving.load_model(args.model, compile=False)
    if args.permute:
        model, _ = tf_sparse24.permute(model, progress=False, print_fn=print)
    pruned = tf_sparse24.prune(model, args.pattern, layers=args.layers, skip=args.skip)
    tf_sparse24.report(pruned)
    partial = os.path.join(directory, f".{name}.{os.getpid()}.partial.keras")
    try:
        pruned.save(partial)
        sync_tree(partial)  # on disk before the rename (see atomic_dir)
        os.replace(partial, args.output)
        sync_tree(directory, recursive=False)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    print(f"saved {len(tf_sparse24.pruned_layers(pruned))} pruned layers to {args.output}: "
          "fine-tune it with Sparse24Callback, then export it")


def _hint(args: argparse.Namespace, error: Exception) -> str:
    """The command-line spelling of what an export error asks for."""
    if "safe_mode" in str(error):  # load_model refuses a Lambda layer's Python code by default
        return (" (here: --import a module that calls "
                "keras.config.enable_unsafe_deserialization(), only for a file you trust)")
    if args.command != "export":
        return ""
    if "input_signature" in str(error):
        return " (here: --input NAME:DTYPE:SHAPE)"
    if args.input and not args.dict_inputs and "infer the output shape" in str(error):
        return " (a model called with a dict of its inputs needs --dict-inputs)"
    return ""


if __name__ == "__main__":
    sys.exit(main())
