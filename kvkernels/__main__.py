"""`python -m kvkernels <command>` (also installed as the `kvkernels` script).

Commands:
  bench     sweep the decode-attention GEMVs over methods and backends (kvkernels.bench; --help for options)
  demo      run kvkernels.demo
  eval      perplexity of each KV format on a trained decoder LM over real text (kvkernels.quality; --help)
  backends  print which backends can run here
  calibrate aqua   fit AQUA-KV's cross-layer predictors on a trained model (kvkernels.aqua; --help)
"""

import importlib.util
import sys

COMMANDS = ("bench", "demo", "eval", "backends", "calibrate")


def _usage() -> str:
    return (__doc__ or "").strip()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from kvkernels import bench

        return bench.main(rest)
    if cmd == "demo":
        if importlib.util.find_spec("kvkernels.demo") is None:
            print("kvkernels: the demo module (kvkernels/demo.py) is not in this install", file=sys.stderr)
            return 2
        from kvkernels import demo

        return demo.main(rest) or 0
    if cmd == "eval":
        from kvkernels import quality

        return quality.main(rest)
    if cmd == "calibrate":
        from kvkernels import aqua

        return aqua.main(rest)
    if cmd == "backends":
        import kvkernels

        for name, status in kvkernels.backends().items():
            print(f"{name:10s} {status}")
        return 0
    print(f"kvkernels: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
