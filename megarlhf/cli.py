"""The ``megarlhf`` command line: one argparse parser whose sub-commands come from a registry.

A sub-command is a :class:`Command` (help text, a function adding its arguments, a function running it)
registered in :data:`COMMANDS` under its name; :func:`build_parser` turns every registered command into
a sub-parser. Adding ``train`` or ``eval`` is one ``COMMANDS.register(name)(Command(...))`` line here.
Command modules import their heavy dependencies (Megatron, transformers, model providers) inside
``run`` so that ``megarlhf --help`` and argument errors answer at once.

Options and positionals may be mixed after the command (``megarlhf plan RECIPE --gpus 8 key=value``):
a command's own arguments are parsed with argparse's ``parse_intermixed_args`` (commands with
sub-commands of their own, like ``convert``, parse as usual).

Errors a user can fix (a missing directory, an incomplete checkpoint, a layout the world size does not
divide, an unsupported model) are printed as one line naming the problem, exit status 1; argument
errors exit with argparse's status 2. An error inside megarlhf prints one line too, its traceback kept in
a file (``--verbose``: on the terminal). On several ranks a message is printed once, by the first rank to
meet it (:mod:`megarlhf.core.console`). ``--nproc-per-node N`` runs a command on N local ranks
(:mod:`megarlhf.launch.local`), like ``torchrun --nproc-per-node N -m megarlhf`` without torchrun's
traceback after a failure.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

from megarlhf import __version__
from megarlhf.checkpoint import convert
from megarlhf.checkpoint import fetch as fetch_command
from megarlhf.core.console import report_error, report_internal_error
from megarlhf.core.errors import UserError
from megarlhf.launch.local import launch_local
from megarlhf.config.parallel import LayoutError
from megarlhf.planner import command as plan_command
from megarlhf.core.registry import Registry
from megarlhf.loops import commands as trainer_commands


@dataclass(frozen=True)
class Command:
    """One ``megarlhf <name>`` sub-command. Registry signature: every entry is a Command."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: Registry[Command] = Registry("megarlhf command")
COMMANDS.register("convert")(Command(
    help="convert between HF model directories and megarlhf distributed checkpoints",
    add_arguments=convert.add_arguments, run=convert.run))
COMMANDS.register("train")(Command(
    help="RL training (GRPO, PPO, DAPO, ... as the recipe says)",
    add_arguments=trainer_commands.add_recipe_arguments, run=trainer_commands.run_train))
COMMANDS.register("sft")(Command(
    help="supervised fine-tuning (loss on response tokens)",
    add_arguments=trainer_commands.add_recipe_arguments, run=trainer_commands.run_sft))
COMMANDS.register("dpo")(Command(
    help="direct preference optimisation on preference pairs (DPO, cDPO, IPO, SimPO) or unpaired rows (KTO)",
    add_arguments=trainer_commands.add_recipe_arguments, run=trainer_commands.run_dpo))
COMMANDS.register("rs")(Command(
    help="rejection sampling in rounds: generate, score, keep the best samples, SFT on them",
    add_arguments=trainer_commands.add_recipe_arguments, run=trainer_commands.run_rs))
COMMANDS.register("online-dpo")(Command(
    help="online (iterative) DPO: pairs from the policy's own samples ranked by the rewards, DPO-family loss",
    add_arguments=trainer_commands.add_recipe_arguments, run=trainer_commands.run_online_dpo))
COMMANDS.register("rm")(Command(
    help="reward-model training on preference pairs (Bradley-Terry), exported as ...ForSequenceClassification",
    add_arguments=trainer_commands.add_recipe_arguments, run=trainer_commands.run_rm))
COMMANDS.register("eval")(Command(
    help="accuracy / pass@k of model.path on data.eval_path",
    add_arguments=trainer_commands.add_eval_arguments, run=trainer_commands.run_eval))
COMMANDS.register("export")(Command(
    help="write the actor of a run checkpoint as an HF directory (LoRA: merged, plus a PEFT adapter)",
    add_arguments=trainer_commands.add_export_arguments, run=trainer_commands.run_export))
COMMANDS.register("plan")(Command(
    help="dry run: per-rank memory plan of a recipe on a layout (no GPU, no weights needed)",
    add_arguments=plan_command.add_arguments, run=plan_command.run))
COMMANDS.register("fetch")(Command(
    help="fetch a known pretrained model (or convert a GGUF file) into an HF model directory",
    add_arguments=fetch_command.add_arguments, run=fetch_command.run))


# Commands that run on several ranks; --nproc-per-node launches them here (megarlhf.launch.local).
LAUNCHABLE = ("convert", "train", "sft", "dpo", "rs", "online-dpo", "rm", "eval", "export")


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser``, or the parsers of its sub-commands (``convert hf-to-megatron``) where it has them."""
    nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [leaf for action in nested for sub in action.choices.values() for leaf in _leaf_parsers(sub)] or [parser]


def add_common_options(parser: argparse.ArgumentParser, launchable: bool) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="tracebacks, dependencies' INFO logs and warnings on the terminal")
    if launchable:
        parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                            help="run on N ranks of this machine (as torchrun would, without its failure report)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarlhf", description="RLHF / RLVR post-training on Megatron-Core.")
    parser.add_argument("--version", action="version", version=f"megarlhf {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS.names():
        command = COMMANDS.get(name)
        sub = commands.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        for leaf in _leaf_parsers(sub):
            add_common_options(leaf, name in LAUNCHABLE)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed; a command's arguments intermixed (options may follow positionals)."""
    parser = build_parser()
    argv = list(argv)
    if not argv or argv[0] not in COMMANDS:
        return parser.parse_args(argv)  # usage, --help, --version, or an unknown command
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = commands.choices[argv[0]]
    if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
        return parser.parse_args(argv)
    args = sub.parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


# Problems with what the user gave, whose message is the whole story (megarlhf.core.errors), and paths the user
# named that cannot be read or written. Any other exception is megarlhf's own and keeps its traceback.
USER_ERRORS = (UserError, LayoutError, FileNotFoundError, FileExistsError, IsADirectoryError,
               NotADirectoryError, PermissionError)


def _without_nproc(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``), runs the command, returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    nproc = getattr(args, "nproc_per_node", None)
    if nproc is not None and "LOCAL_RANK" not in os.environ:  # the launcher, not a rank
        if nproc < 1:
            report_error(args.command, f"--nproc-per-node must be >= 1, got {nproc}")
            return 2
        return launch_local(_without_nproc(argv), nproc)
    # Import-time notices of the libraries (no Apex / Transformer Engine on CPU, their internal
    # deprecations) tell a user of the command nothing they can act on.
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint")
    # Megatron-Core 0.19's DDP buffers call all_gather_into_tensor / reduce_scatter_tensor, which torch 2.13
    # deprecates (the warning is raised in torch's c10d_logger, so the filter above misses it); megarlhf
    # calls neither.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    # Megatron's distributed optimizer reads .grad of its fp32 shard views in zero_grad (its own comment:
    # "throws grad-access warning"); on CPU the call passes through parallel.cpu_compat's torch-function
    # mode, which the warning then names instead of Megatron.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"parallel\.cpu_compat",
                            message=r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed")
    # Megatron's dist_checkpointing loads optimizer state through torch's ShardedTensor, whose torch-function
    # hook torch deprecates; the warning names the frame that made the torch call (a megarlhf loader or
    # parallel.cpu_compat's mode), so a resume printed it as megarlhf's own.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"Please use DTensor instead and we are deprecating ShardedTensor")
    try:
        return COMMANDS.get(args.command).run(args)
    except USER_ERRORS as err:
        report_error(args.command, str(err))
        return 1
    except Exception as err:  # noqa: BLE001 - megarlhf's own error: one line, the traceback kept
        if args.verbose:
            raise
        report_internal_error(args.command, err)
        return 1
