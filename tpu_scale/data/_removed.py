"""Names the data package no longer has, each failing with the way that replaced it."""


class removed:
    """A class attribute that is gone: reading it raises `AttributeError` with `message`, which
    names what to use instead.

        class ImageNetInput:
            from_tfds = removed('... data.inputs("tfds:imagenet2012", ...) ...')
    """

    def __init__(self, message):
        self.message = message

    def __get__(self, instance, owner=None):
        raise AttributeError(self.message)
