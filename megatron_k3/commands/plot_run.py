"""Render a run's loss and routing plots to PNG:  python tools/plot_run.py RUN_DIR"""


from megatron_k3.cli import ArgumentParser, friendly_errors
from megatron_k3.train.plots import plot_run


@friendly_errors
def main():
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("run_dir")
    for p in plot_run(ap.parse_args().run_dir):
        print(p)


if __name__ == "__main__":
    main()
