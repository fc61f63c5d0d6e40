if not __name__.startswith("pagedserve."):  # else its classes would exist twice, under two names
    # In a checkout this folder shadows Hugging Face's `kernels`, which transformers probes by
    # importing the name and reading __version__: the bare name loads empty, and only using it
    # fails.
    __path__ = []

    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"{__name__} is a layer of pagedserve: import it as "
                          f"pagedserve.{__name__} (from pagedserve.{__name__}... import ...)")
