"""`simulate`'s options for the policy's cost model and for hosts whose true costs differ from it.

    --cost-model shared                   the shared-parameter online model (`control.online_cost`)
    --profile none --clock-profile A      the policy starts from the generic shape on machine A
    --profile-scale draft=1.3,verify-token=0.8   the policy's profile, scaled (`price_error.scaled_profile`)
    --clock-change 1000:draft=1.3         after 1000 steps the machine's draft costs 1.3x
    --price-errors                        report the policy's relative price error of K = 1..6 vs K = 0
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_cost_model_options", "load_profiles", "cost_model_options"]


def add_cost_model_options(parser) -> None:
    from ..control.online_cost import COST_MODELS

    parser.add_argument("--cost-model", choices=COST_MODELS, default="cells",
                        help="the policy's online cost correction: cells (per (batch, K) cell) or shared "
                             "(parameters shared by every cell, control/online_cost.py)")
    parser.add_argument("--profile-scale", default=None, metavar="draft=X,verify-token=Y",
                        help="scale the policy's profile: the draft's times by X, each verify's cost above its "
                             "one-token verify by Y (the machine keeps --clock-profile, or the unscaled profile)")
    parser.add_argument("--clock-change", default=None, metavar="STEP:draft=X,verify-token=Y",
                        help="after STEP steps the machine's costs are its profile scaled so (a mid-run change)")
    parser.add_argument("--price-errors", action="store_true",
                        help="report the policy's relative price error of K = 1..6 against K = 0 per step")


def load_profiles(args) -> tuple[dict, dict | None, dict | None]:
    """(the machine's profile for names and the host, the clock profile or None, the policy's
    profile or None for the generic shape) from --profile, --clock-profile and --profile-scale."""
    from ..profiling.profile_file import ProfileError, load_profile
    from ..simulation.price_error import parse_scaling, scaled_profile

    try:
        clock_profile = load_profile(args.clock_profile) if args.clock_profile else None
        if str(args.profile).lower() == "none":
            if clock_profile is None:
                raise ValueError("--profile none needs --clock-profile: the machine the steps run on")
            return clock_profile, clock_profile, None
        profile = load_profile(args.profile)
    except ProfileError as error:
        raise ValueError(str(error)) from None
    if getattr(args, "profile_scale", None):
        clock_profile = clock_profile if clock_profile is not None else profile
        return profile, clock_profile, scaled_profile(profile, **parse_scaling(args.profile_scale))
    return profile, clock_profile, profile


def cost_model_options(args, machine: dict) -> dict[str, Any]:
    """`simulate`'s cost_model, clock_change and price_errors arguments; `machine` is the profile
    the steps run on (its scaled copy is the clock after --clock-change)."""
    from ..simulation.price_error import ClockChange, parse_scaling, scaled_profile

    change = None
    if getattr(args, "clock_change", None):
        step, _, scaling = args.clock_change.partition(":")
        try:
            at = int(step)
        except ValueError:
            raise ValueError(f"--clock-change is STEP:draft=X,verify-token=Y, got {args.clock_change!r}") from None
        change = ClockChange(at, scaled_profile(machine, **parse_scaling(scaling)))
    return {"cost_model": getattr(args, "cost_model", "cells"), "clock_change": change,
            "price_errors": bool(getattr(args, "price_errors", False))}
