"""``mount.fuse.cachefs``: lets mount(8) and /etc/fstab mount a cachefs.

``mount -t fuse.cachefs BACKING MOUNTPOINT -o cache_dir=DIR,cache_size=500G`` makes
mount(8) run, as its EXTERNAL HELPERS section describes,

    /sbin/mount.fuse.cachefs BACKING MOUNTPOINT [-sfnv] [-N NS] -o OPTIONS [-t fuse.cachefs]

This module turns OPTIONS into ``cachefs mount`` flags (``cache_dir=X`` becomes
``--cache-dir X``, ``allow_other`` becomes ``--allow-other``) and runs it, so the
helper returns once the mount serves, as mount(8) expects.  The options are read from
``cachefs mount``'s own parser (:func:`cachefs.service.cli.add_mount_arguments`), so every
flag is an option, ``cache-size`` or ``cache_size`` as the writer prefers, except those
that make no sense at mount(8)'s hands (``foreground``, ``dry_run``), which are refused.
Options meant for mount(8) or systemd (rw, ro, defaults, noauto, _netdev, nofail,
x-systemd.*, ...) are ignored: a cachefs mount is always read-only, nosuid and nodev.
Any other option is rejected in one line, unless ``-s`` (sloppy) is given.

mount(8) looks for helpers in /sbin, /sbin/fs.d and /sbin/fs, never in $PATH, so the
console script has to be linked there once:

    ln -s "$(command -v mount.fuse.cachefs)" /sbin/mount.fuse.cachefs

An /etc/fstab line, the settings in a config file (flags and the fstab fields
override it); ``nofail`` so that a dead remote does not stop the boot,
``x-systemd.requires-mounts-for=/mnt/efs`` to order it after the NFS mount:

    /mnt/efs/imagenet /mnt/imagenet fuse.cachefs config=/etc/cachefs/imagenet.toml,nofail 0 0

or with the settings inline: ``cache_dir=/nvme/cachefs/imagenet,cache_size=500G,...``.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import getopt
import sys

from cachefs.kernel.mountpoint import FSTYPE
from cachefs.service import cli

PROG = "mount.fuse.cachefs"
# mount(8)'s exit codes: 1 incorrect invocation, 32 mount failure.
EXIT_USAGE = 1
EXIT_MOUNT_FAILED = 32

# Generic options of mount(8), FUSE and fstab that cachefs has no use for: the mount is
# read-only, nosuid and nodev, and checks permissions (default_permissions) anyway.
IGNORED_OPTIONS = frozenset({
    "defaults", "rw", "ro", "auto", "noauto", "user", "nouser", "users", "owner", "group",
    "_netdev", "nofail", "suid", "nosuid", "dev", "nodev", "exec", "noexec",
    "atime", "noatime", "relatime", "norelatime", "strictatime", "nostrictatime",
    "diratime", "nodiratime", "lazytime", "nolazytime", "sync", "async", "dirsync",
    "silent", "loud", "iversion", "noiversion", "mand", "nomand", "default_permissions",
})
# x-systemd.*, x-initrd.mount, X-mount.mkdir and the like are for other programs;
# comment= is fstab's free text.
IGNORED_PREFIXES = ("x-", "X-", "comment=")


class HelperError(Exception):
    """Bad invocation; the message is the one line shown to the user."""


@functools.cache
def mount_options() -> dict[str, argparse.Action]:
    """-o NAME -> the ``cachefs mount`` flag it stands for, from the flags themselves."""
    parser = argparse.ArgumentParser(add_help=False)
    cli.add_mount_arguments(parser)
    options = {}
    for action in parser._actions:
        long_flags = [flag for flag in action.option_strings if flag.startswith("--")]
        if long_flags:
            options[long_flags[0][2:].replace("-", "_")] = action
    return options


def takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def translate_options(options: str, *, sloppy: bool = False) -> list[str]:
    """A mount(8) ``-o`` string as ``cachefs mount`` flags."""
    known = mount_options()
    flags: list[str] = []
    for option in filter(None, options.split(",")):
        if option in IGNORED_OPTIONS or option.startswith(IGNORED_PREFIXES):
            continue
        name, has_value, value = option.partition("=")
        key = name.replace("-", "_")
        action = known.get(key)
        if action is None:
            if sloppy:
                continue
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise HelperError(f"unknown option {option!r}; {hint}the options are the flags of "
                              "'cachefs mount --help' without the leading --")
        if key in cli.NOT_FOR_FSTAB:
            reason = cli.NOT_FOR_FSTAB[key]
            raise HelperError(f"option {name} is not for mount(8) or fstab: {reason}")
        flag = action.option_strings[-1]
        if takes_value(action):
            if not has_value or not value:
                raise HelperError(f"option {name} needs a value: {name}=...")
            flags += [flag, value]
        else:
            if has_value:
                raise HelperError(f"option {name} takes no value; write just {name}")
            flags.append(flag)
    return flags


def build_command(argv: list[str]) -> tuple[list[str], bool, bool]:
    """mount(8)'s helper arguments -> (cachefs argv, fake, verbose)."""
    try:
        opts, operands = getopt.gnu_getopt(argv, "sfnvN:o:t:")
    except getopt.GetoptError as exc:
        raise HelperError(str(exc)) from None
    if len(operands) != 2:
        raise HelperError("usage: mount.fuse.cachefs BACKING MOUNTPOINT [-o OPTIONS]")
    options, sloppy, fake, verbose = [], False, False, False
    for opt, value in opts:
        if opt == "-o":
            options.append(value)
        elif opt == "-s":
            sloppy = True
        elif opt == "-f":
            fake = True
        elif opt == "-v":
            verbose = True
        elif opt == "-N":
            raise HelperError("mounting in another namespace (-N) is not supported; run mount "
                              "inside it instead")
        elif opt == "-t" and value not in (FSTYPE, "cachefs"):
            raise HelperError(f"this helper mounts {FSTYPE}, not {value}")
        # -n (do not write /etc/mtab): there is no mtab to write.
    backing, mountpoint = operands
    flags = translate_options(",".join(options), sloppy=sloppy)
    return ["mount", backing, mountpoint, *flags], fake, verbose


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command, fake, verbose = build_command(argv)
    except HelperError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if verbose or fake:
        print(f"{PROG}: cachefs {' '.join(command)}", file=sys.stderr)
    if fake:
        return 0
    return 0 if cli.main(command) == 0 else EXIT_MOUNT_FAILED


if __name__ == "__main__":
    sys.exit(main())
