"""Where a run's devices go: the (data, ep, tensor) mesh sizes of train's and serve's flags
(`mesh_sizes`), and the one-line errors naming the flag when they do not fit."""

from __future__ import annotations


def mesh_sizes(
    num_devices: int,
    *,
    ep_size: int,
    tensor_size: int,
    num_experts: int,
    d_ff: int,
    ranks_per_domain: int = 0,
    transfer_chunks: int = 1,
) -> tuple[int, int, int]:
    """(data, ep, tensor) mesh sizes for ``num_devices`` (train's and serve's): ``ep_size`` 0
    takes every device the tensor axis leaves; raises ValueError (one line naming the flag and
    what fits) for sizes that do not divide the devices, the experts or the hidden width."""
    tensor = tensor_size
    if num_devices % tensor:
        raise ValueError(f"--tensor_size={tensor} does not divide the {num_devices} devices")
    if d_ff % tensor:
        raise ValueError(f"--d_ff={d_ff} is not divisible by --tensor_size={tensor}")
    token_devices = num_devices // tensor
    ep = ep_size or token_devices
    if token_devices % ep:
        raise ValueError(_ep_size_error(ep, num_devices, tensor, num_experts))
    if num_experts % ep:
        raise ValueError(f"--num_experts={num_experts} is not divisible by the EP size {ep}")
    if ranks_per_domain and ep % ranks_per_domain:
        raise ValueError(
            f"--ranks_per_domain={ranks_per_domain} does not divide the EP size {ep} (a fast "
            "domain is that many consecutive ranks of the expert axis)"
        )
    if transfer_chunks > d_ff // tensor:
        raise ValueError(
            f"--transfer_chunks={transfer_chunks} exceeds the {d_ff // tensor} hidden columns of "
            "an expert on a device (--d_ff / --tensor_size): a chunk is at least one column"
        )
    return token_devices // ep, ep, tensor


def _ep_size_error(ep: int, num_devices: int, tensor: int, num_experts: int) -> str:
    """The one line for an ``--ep_size`` that does not divide the devices the data and expert
    axes share (``num_devices`` / ``tensor``), with the values that do (and divide the
    experts)."""
    devices = num_devices // tensor
    where = f"the {num_devices} devices"
    if tensor > 1:
        where = f"the {devices} devices that --tensor_size={tensor} leaves of {num_devices}"
    fits = [str(d) for d in range(1, devices + 1) if devices % d == 0 and num_experts % d == 0]
    listed = fits[0] if len(fits) == 1 else f"{', '.join(fits[:-1])} or {fits[-1]}"
    every = f", or 0 for all {devices}" if num_experts % devices == 0 else ""
    return (
        f"--ep_size={ep} does not divide {where} (the data x expert axes); use --ep_size="
        f"{listed}{every}"
    )


def one_ep_rank_error(num_devices: int, tensor: int) -> str:
    """The one line for --balance=ultraep where --tensor_size leaves the expert axis one device
    (--ep_size=0: all it leaves): every expert on one rank, nothing to balance, and a run that
    said nothing of it."""
    return (
        f"--tensor_size={tensor} leaves 1 of the {num_devices} devices to the data x expert "
        "axes: one EP rank, nothing for --balance=ultraep to balance; use a smaller "
        "--tensor_size, --balance=none, or --ep_size=1 to run so anyway"
    )
