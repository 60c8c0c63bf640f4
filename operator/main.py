"""`pagedinfer operator`: run the InferenceEngine operator (same as `kopf run -m pagedinfer.operator.entrypoint`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import sys

from pagedinfer.operator.config import OperatorConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedinfer operator", description="Run the InferenceEngine operator.")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The operator's flags (shared by this parser and the `pagedinfer operator` subcommand)."""
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    p.add_argument(
        "--peering", default=None, help="peering name for HA replicas (needs the KopfPeering CRDs)"
    )
    p.add_argument("--standalone", action="store_true", help="no peering: the only operator instance")
    p.add_argument("--priority", type=int, default=None, help="peering priority (default: random)")
    p.add_argument("--metrics-port", type=int, default=None, help="port of /metrics and /healthz (0: off)")
    p.add_argument("--image-gpu", default=None, help="default engine image for GPU engines")
    p.add_argument("--image-cpu", default=None, help="default engine image for CPU engines")
    p.add_argument("--resync-seconds", type=float, default=None, help="full reconcile interval")
    p.add_argument("--stats-seconds", type=float, default=None, help="pod metrics scrape interval")
    p.add_argument("--log-format", choices=["plain", "full", "json"], default="json")
    p.add_argument("-v", "--verbose", action="store_true")


def config_from_args(args: argparse.Namespace, base: OperatorConfig) -> OperatorConfig:
    overrides = {
        "namespaces": tuple(args.namespace) or base.namespaces,
        "metrics_port": args.metrics_port,
        "image_gpu": args.image_gpu,
        "image_cpu": args.image_cpu,
        "resync_seconds": args.resync_seconds,
        "stats_seconds": args.stats_seconds,
    }
    if args.all_namespaces:
        overrides["namespaces"] = ()
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the operator until interrupted."""
    import kopf

    from pagedinfer.operator.handlers import register

    config = config_from_args(args, OperatorConfig.from_env())
    log_format = {"plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}
    kopf.configure(verbose=args.verbose, log_format=log_format[args.log_format])
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    registry = kopf.OperatorRegistry()
    register(registry, config)

    @kopf.on.login(registry=registry)
    async def login(**kwargs: object) -> kopf.ConnectionInfo | None:
        # In-cluster service account or the kubeconfig (exec plugins included), as k8s.py loads it.
        return await kopf.login_via_async_client(**kwargs)

    standalone = args.standalone or args.peering is None
    priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
    try:
        asyncio.run(
            kopf.operator(
                registry=registry,
                clusterwide=not config.namespaces,
                namespaces=list(config.namespaces),
                standalone=standalone,
                peering_name=args.peering,
                priority=priority,
                memo=kopf.Memo(),
            )
        )
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
