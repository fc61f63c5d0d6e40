if not __name__.startswith("pagedserve."):  # else its classes would exist twice, under two names
    raise ImportError(f"{__name__} is a layer of pagedserve: import it as pagedserve.{__name__} "
                      f"(from pagedserve.{__name__}... import ...)")
