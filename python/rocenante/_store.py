"""Keys of the torch.distributed store that rocenante shares among ranks."""

from __future__ import annotations

from rocenante import _C


def generation(store, base: str, counter: str, size: int) -> str:
    """The key prefix for this rank's next opening under `base`, among `size` ranks: every rank draws one ticket
    from `base/counter` per opening, and all tickets of one opening are drawn before any of the next (each rank
    must finish an opening before it starts the next), so the ranks of an opening share one generation and never
    read keys of an earlier one. The counter may hold anything another program wrote: it is checked."""
    key = f"{base}/{counter}"
    try:
        ticket = store.add(key, 1)
    except ValueError:  # the store could not count on the value there
        raise _C.RocenanteError(f"the store's key {key} holds something other than a count") from None
    if ticket < 1:
        raise _C.RocenanteError(f"the store's key {key} gave ticket {ticket}: something other than rocenante wrote it")
    return f"{base}/{(ticket - 1) // size}"
