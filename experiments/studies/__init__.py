"""Studies: experiments that produce a results JSON and the tables generated from it."""
