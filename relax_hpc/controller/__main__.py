"""``python -m relax_hpc.controller RUN_DIR``: run the job to its end; exit 0 if it COMPLETED, else 1."""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m relax_hpc.controller RUN_DIR", file=sys.stderr)
        return 2
    from relax_hpc.controller.loop import run_controller

    try:
        run_controller(argv[0])
    except Exception as e:  # the reason is already in the log and state.json; say it once more, last
        print(f"relax_hpc controller: run failed: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
