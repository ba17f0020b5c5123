"""`speculant train dflash`: the drafter's training module, loop and command."""
