"""What ``stagefs --help`` says beyond the options: examples, sizes, environment variables;
and what is generated from the parser: the bash completion script and docs/cli.md
(``python -m stagefs._help > docs/cli.md``; tests/unit/test_cli_help.py checks it is current).
"""

from __future__ import annotations

import argparse
import textwrap

from stagefs.config import ENV_VARS, SIZE_SYNTAX

__all__ = ["COMMANDS", "EXIT_STATUS", "Formatter", "bash_completion", "commands", "epilog",
           "markdown"]

_STORE = ("STAGEFS_TIERS", "STAGEFS_RUNTIME", "STAGEFS_JOB", "STAGEFS_READ_THREADS",
          "STAGEFS_ORIGIN_READAHEAD", "STAGEFS_ORIGIN_DIRECT", "STAGEFS_SPEEDUPS",
          "STAGEFS_MALLOC_TUNE", "STAGEFS_TIER_MAP")
_CONNECT = ("STAGEFS_CONNECT_TIMEOUT", "STAGEFS_PEER_TIMEOUT")
_JOB = ("STAGEFS_RUNTIME", "STAGEFS_JOB")

# command -> (two or more examples, the STAGEFS_* variables it reads, whether it takes sizes)
COMMANDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {
    "pack": (("stagefs pack /data/imagenet /data/imagenet.pack",
              "stagefs pack --shard-size 256MiB --compress none -j 16 /data/audio "
              "/scratch/audio.pack"), (), True),
    "unpack": (("stagefs unpack /data/imagenet.pack /tmp/imagenet",
                "stagefs unpack imagenet.pack restored && diff -r imagenet restored"),
               _STORE, False),
    "ls": (("stagefs ls /data/imagenet.pack train",
            "stagefs ls -l /data/imagenet.pack train/n01440764"), _STORE, False),
    "stat": (("stagefs stat /data/imagenet.pack train/n01440764/n01440764_10026.JPEG",
              "stagefs stat /data/imagenet.pack train"), _STORE, False),
    "cat": (("stagefs cat /data/imagenet.pack labels.txt",
             "stagefs cat /data/imagenet.pack train/n01440764/n01440764_10026.JPEG > x.jpg"),
            _STORE, False),
    "info": (("stagefs info /data/imagenet.pack",
              "stagefs info /lustre/$USER/imagenet.pack | grep shards"), _STORE, False),
    "verify": (("stagefs verify /data/imagenet.pack",
                "stagefs verify -j 32 /data/imagenet.pack || echo 'some files are corrupt'"),
               ("STAGEFS_ORIGIN_READAHEAD",), False),
    "demo": (("stagefs demo",
              "stagefs demo --origin /lustre/$USER/demo --size 2GiB   # on your file system"),
             _STORE, True),
    "run": (("stagefs run --dataset /data/imagenet.pack --at /data/imagenet -- python train.py",
             "stagefs run --dataset /data/imagenet.pack --at /data/imagenet "
             "--tier /dev/shm/$USER/data:50% -- python train.py",
             "stagefs run --connect --at /data/imagenet -- python train.py   # cluster",
             "stagefs run --dataset /data/imagenet.pack --at /data/imagenet -- "
             "tar cf - -C /data imagenet | ssh host tar xf -   # any program"),
            _STORE + _CONNECT, True),
    "mount": (("stagefs mount /data/imagenet.pack /mnt/imagenet --tier /dev/shm/$USER/data:16GiB",
               "stagefs mount --connect /mnt/imagenet   # the cluster's dataset",
               "stagefs mount -f /data/imagenet.pack ~/mnt   # until Ctrl-C"),
              (*_STORE, *_CONNECT, "STAGEFS_FUSE_PUSH"), True),
    "umount": (("stagefs umount /mnt/imagenet", "stagefs umount --lazy ~/mnt   # while in use"), (),
               False),
    "stage": (("stagefs stage /data/imagenet.pack --tier /dev/shm/$USER/data:16GiB "
               "--tier /nvme/$USER/data:80%",
               "STAGEFS_TIERS=/dev/shm/$USER/data:50% stagefs stage /data/imagenet "
               "--no-progress   # a raw directory, in place"), _STORE, True),
    "status": (("stagefs status",
                "stagefs status --json --job train-7",
                "stagefs status --wait-staged 1800   # cluster: until every node has staged"),
               _JOB, False),
    "serve": (("mpirun -ppn 1 stagefs serve /shared/imagenet.pack "
               "--tier /dev/shm/$USER/data:64GiB --replicas 2 --wait",
               "srun --nodes=$SLURM_NNODES --ntasks=$SLURM_NNODES --ntasks-per-node=1 "
               "stagefs serve /shared/imagenet.pack "
               "--tier /nvme/$USER/data:80% --interface ib0",
               "stagefs serve --new-token tok && stagefs serve /shared/imagenet.pack "
               "--hosts hosts --rank 0 --token-file tok --tier /dev/shm/$USER/data:50%"),
              (*_JOB, "STAGEFS_INTERFACE", "STAGEFS_ORIGIN_READAHEAD", "STAGEFS_ORIGIN_DIRECT",
               "STAGEFS_SPEEDUPS",
               "STAGEFS_MALLOC_TUNE", "STAGEFS_RELAY_PIPES"), True),
    "clean": (("stagefs clean", "stagefs clean --job train-7",
               "stagefs clean --all --force   # every job of yours on this node"),
              _JOB, False),
    "doctor": (("stagefs doctor",
                "stagefs doctor --tier /dev/shm/$USER/data:16GiB --tier /nvme/$USER/data:80%"),
               ("STAGEFS_TIERS", "STAGEFS_SPEEDUPS", "STAGEFS_JOB"), True),
    "bench": (("stagefs bench --files 2000 --out bench-results",
               "stagefs bench --origin /lustre/$USER/bench --systems plain-origin "
               "stagefs-tiers --runs 1"), ("STAGEFS_BENCH_PEER_PYTHON",), False),
    "completion": (("eval \"$(stagefs completion bash)\"   # in ~/.bashrc",
                    "stagefs completion bash > ~/.local/share/bash-completion/completions/"
                    "stagefs"), (), False),
}

OVERVIEW = """\
Start here:
  stagefs demo                                    see what it does, in about a minute
  stagefs pack /data/imagenet /data/imagenet.pack convert a dataset once
  stagefs stage /data/imagenet.pack --tier /dev/shm/$USER/data:16GiB
  stagefs run --dataset /data/imagenet.pack --at /data/imagenet -- python train.py
  stagefs COMMAND --help                          options, defaults, examples

Reference: docs/cli.md. Shell completion: eval "$(stagefs completion bash)" (zsh: run
'autoload -U +X bashcompinit && bashcompinit' first)."""

EXIT_STATUS = """\
Exit status:
  0    done
  1    an error, said on stderr; also: verify, a file is corrupt; cat, a file could not be
       read; stage, copying a shard failed (one that found no room left is not an error);
       status, no runtime, a node unreachable, or not staged within --wait-staged; doctor,
       a tier cannot be used; bench, a system failed or read wrong bytes
  2    a command line that cannot work (the command's usage is shown)
  126  run: the command is not executable (else run ends with the command's status)
  127  run: the command is not found
  130  Ctrl-C, after cleaning up
  141  the reader of the output went away (stagefs ... | head)
  143  SIGTERM (scancel, the job's time limit), after cleaning up as after Ctrl-C
       (serve and mount -f end at either signal with 0)"""

_WIDTH = 88


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option that has one; descriptions and epilogs kept as
    written (they hold examples)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if _default(action) is None:
            return action.help
        return super()._get_help_string(action)


def _default(action: argparse.Action) -> str | None:
    """The default worth showing: none for flags, for None, and where the help says it."""
    d = action.default
    if (d is None or isinstance(d, bool) or d is argparse.SUPPRESS or action.nargs == 0
            or "default" in (action.help or "")):
        return None
    return " ".join(map(str, d)) if isinstance(d, list) else str(d)


def _env_lines(names: tuple[str, ...]) -> list[str]:
    if not names:
        return ["Environment: this command reads no STAGEFS_* variable."]
    width = max(len(n) for n in names)
    out = ["Environment:"]
    for n in names:
        v = ENV_VARS[n]
        out += textwrap.wrap(f"{v.doc} (default: {v.default})", _WIDTH,
                             initial_indent=f"  {n:<{width}}  ",
                             subsequent_indent=" " * (width + 4))
    return out


def _wrap(example: str, width: int = _WIDTH - 4) -> str:
    """A long command line broken before its options, shell style (`` \\`` newline)."""
    lines = [""]
    for word in example.replace(" --", "\0--").split("\0"):
        if lines[-1] and len(lines[-1]) + len(word) + 7 > width:
            lines.append("")
        lines[-1] += (" " if lines[-1] else "") + word
    return " \\\n    ".join(lines)


def epilog(command: str | None) -> str:
    """The text after a command's options (or, for None, after the overview)."""
    if command is None:
        public = tuple(n for n, v in ENV_VARS.items() if not v.internal)
        return "\n\n".join([OVERVIEW, textwrap.fill(SIZE_SYNTAX, _WIDTH),
                            "\n".join(_env_lines(public)), EXIT_STATUS])
    if command not in COMMANDS:  # a new command: tests/unit/test_cli_help.py asks for its entry
        return ""
    examples, names, sizes = COMMANDS[command]
    parts = ["Examples:\n" + "\n".join(f"  {_wrap(e)}" for e in examples)]
    parts.append(textwrap.fill(SIZE_SYNTAX if sizes else SIZE_POINTER, _WIDTH))
    parts.append("\n".join(_env_lines(names)))
    return "\n\n".join(parts)


SIZE_POINTER = ("Sizes, where stagefs takes them (--tier, $STAGEFS_TIERS, --shard-size): "
                "2GiB, 500MB, 1.5TB, 4096, or 50% of a tier's free space (stagefs --help).")


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers, by name, in the order they were added."""
    for action in parser._actions:  # argparse has no public way to list them
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(sp: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in sp._actions if not isinstance(a, argparse._HelpAction)]


# -- shell completion ---------------------------------------------------------------------

_BASH = """\
# bash completion for stagefs (generated by 'stagefs completion bash')
_stagefs() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} cmd="" i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case ${COMP_WORDS[i]} in -*) ;; *) cmd=${COMP_WORDS[i]}; break ;; esac
    done
    local opts="" args=""
    case $cmd in
%(commands)s
    esac
    case "$cmd $prev" in
%(choices)s
    esac
    if [[ -z $cmd || $cur == -* ]]; then args=$opts; fi
    COMPREPLY=($(compgen -W "$args" -- "$cur"))  # none: file names (-o default)
}
complete -o default -o bashdefault -F _stagefs stagefs
"""


def bash_completion(parser: argparse.ArgumentParser) -> str:
    """A bash completion script for ``parser``: commands, each command's options, the
    choices of an option or an argument; file names otherwise."""
    cmds = commands(parser)
    top = [o for a in _options(parser) for o in a.option_strings]
    lines = [f'        "") opts="{" ".join([*cmds, *top, "--help"])}" ;;']
    choices: list[str] = []
    for name, sp in cmds.items():
        opts = " ".join(o for a in sp._actions for o in a.option_strings)
        args = " ".join(str(c) for a in sp._actions if not a.option_strings
                        for c in a.choices or ())
        lines.append(f'        {name}) opts="{opts}"; args="{args}" ;;')
        choices += [f'        "{name} {o}") opts=""; args="{" ".join(map(str, a.choices))}" ;;'
                    for a in sp._actions if a.choices and a.option_strings
                    for o in a.option_strings]
    return _BASH % {"commands": "\n".join(lines), "choices": "\n".join(choices)}


# -- docs/cli.md --------------------------------------------------------------------------

def _usage(name: str, sp: argparse.ArgumentParser) -> str:
    parts = [f"stagefs {name}"]
    if any(a.option_strings for a in _options(sp)):
        parts.append("[OPTIONS]")
    for a in _options(sp):
        if a.option_strings:
            continue
        meta = str(a.metavar or a.dest)
        if a.choices:
            meta = "{" + ",".join(map(str, a.choices)) + "}"
        parts.append({"?": f"[{meta}]", "+": f"{meta} [{meta} ...]", "*": f"[{meta} ...]",
                      argparse.REMAINDER: "-- COMMAND [ARGS ...]"}.get(str(a.nargs), meta))
    return " ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _arg_name(a: argparse.Action) -> str:
    if not a.option_strings:
        return str(a.metavar or a.dest)
    if a.nargs == 0:
        return ", ".join(a.option_strings)
    meta = a.metavar or ("{" + ",".join(map(str, a.choices)) + "}" if a.choices
                         else a.dest.upper())
    return ", ".join(a.option_strings) + f" {meta}"


def _command_md(name: str, sp: argparse.ArgumentParser) -> list[str]:
    examples, names, sizes = COMMANDS[name]
    out = [f"## stagefs {name}", "", sp.description or "", "", "```",
           _usage(name, sp), "```", "", "| argument | default | meaning |",
           "| --- | --- | --- |"]
    for a in _options(sp):
        d = _default(a)
        out.append(f"| `{_cell(_arg_name(a))}` | {f'`{_cell(d)}`' if d else ''} | "
                   f"{_cell(a.help or '')} |")
    out += ["", "Examples:", "", "```bash", *map(_wrap, examples), "```", ""]
    if sizes:
        out += ["Sizes: see [Sizes](#sizes).", ""]
    env = ", ".join(f"`{n}`" for n in names) or "none"
    out += [f"Environment ([all variables](#environment)): {env}.", ""]
    return out


def markdown(parser: argparse.ArgumentParser) -> str:
    """docs/cli.md: every command, option, default and example, from the parser."""
    cmds = commands(parser)
    out = ["# The stagefs command", "",
           "<!-- generated by `python -m stagefs._help > docs/cli.md` from the parser in "
           "src/stagefs/cli.py; do not edit (tests/unit/test_cli_help.py checks it) -->", "",
           parser.description or "", "", "```", OVERVIEW, "```", "", "| command | purpose |",
           "| --- | --- |"]
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in subs._choices_actions}
    out += [f"| [`{n}`](#stagefs-{n}) | {_cell(helps.get(n, ''))} |" for n in cmds]
    sizes = SIZE_SYNTAX.removeprefix("Sizes: ")
    out += ["", "## Sizes", "", sizes[0].upper() + sizes[1:], "", "## Environment", "",
            "Every `STAGEFS_*` variable stagefs reads (an empty value counts as unset):", "",
            "| variable | default | meaning |", "| --- | --- | --- |"]
    out += [f"| `{v.name}` | `{_cell(v.default)}` | {_cell(v.doc)} |"
            for v in ENV_VARS.values() if not v.internal]
    out += ["", "Set by stagefs for the processes it starts (not for users): "
            + ", ".join(f"`{v.name}`" for v in ENV_VARS.values() if v.internal) + ".", ""]
    out += ["## Exit status", "", "```", EXIT_STATUS.split("\n", 1)[1], "```", ""]
    for name, sp in cmds.items():
        out += _command_md(name, sp)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    from stagefs.cli import build_parser

    print(markdown(build_parser()), end="")
