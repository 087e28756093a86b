"""More than one rank: process groups, data parallel, launch, the sharded base and its lockstep."""
