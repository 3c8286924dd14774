"""Parameter counts of a K3 config (meta-device instantiation of the golden model).

    python tools/model_info.py --preset k3-full [--json]
    python tools/model_info.py --config my_model.yaml
"""
import argparse
import json


from megatron_k3.cli import ArgumentParser, UsageError, friendly_errors
from megatron_k3.config import PRESETS, get_preset, load_config


@friendly_errors
def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", help=f"one of: {', '.join(PRESETS)}")
    ap.add_argument("--config", help="model config file (.yaml/.json/.toml)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    if bool(args.preset) == bool(args.config):
        raise UsageError("give exactly one of --preset NAME or --config FILE")
    cfg = get_preset(args.preset) if args.preset else load_config(args.config)
    from megatron_k3.plan.model_info import format_info, model_info

    info = model_info(cfg)
    print(json.dumps(info, indent=2) if args.json else format_info(info))


if __name__ == "__main__":
    main()
