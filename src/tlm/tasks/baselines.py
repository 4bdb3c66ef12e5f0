"""The baseline a fine-tuned encoder is measured against (J&M §11.4's point: pretraining
carries over): bag-of-words logistic regression from scikit-learn on the same examples and
split, scored by the same functions (`evaluate.accuracy_f1`, `entity_f1`).

    classify   the text's word counts (whitespace-split words) -> the label
    tag        the word itself (one feature per distinct word) -> its tag

A word the training examples never had is a row of zeros: the baseline knows words, not
their pieces or their context, which is what a pretrained encoder adds.
"""

from __future__ import annotations

from tlm.data.labeled import LabeledData
from tlm.errors import UserError
from tlm.evaluate import accuracy_f1, entity_f1


def bag_of_words(data: LabeledData) -> dict[str, float]:
    """{accuracy, f1} of logistic regression on bags of words, trained on `data.train`,
    scored on `data.val`."""
    try:
        from sklearn.feature_extraction.text import CountVectorizer
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        raise UserError('the baseline needs scikit-learn: pip install "tlm[encoder]"') from None
    words = CountVectorizer(analyzer=str.split)  # whitespace words, case kept
    fit = LogisticRegression(max_iter=2000)
    if data.task == "classify":
        texts = [_text(e) for e in data.train]
        fit.fit(words.fit_transform(texts), [e.label for e in data.train])
        guesses = fit.predict(words.transform([_text(e) for e in data.val])).tolist()
        return accuracy_f1([e.label for e in data.val], guesses, len(data.labels))
    single = CountVectorizer(analyzer=lambda word: [word])
    fit.fit(
        single.fit_transform([w for e in data.train for w in e.first]),
        [t for e in data.train for t in e.label],
    )
    names = data.labels
    gold = [[names[t] for t in e.label] for e in data.val]
    guessed = [[names[t] for t in fit.predict(single.transform(list(e.first)))] for e in data.val]
    return entity_f1(gold, guessed)


def _text(example) -> str:
    return example.first if example.second is None else f"{example.first} {example.second}"
