"""The baselines: a bag-of-words logistic regression that fits what it can, deterministically, and chance.

Run: python -m pytest tests/tasks/test_classifier.py -q -s    (-s shows the accuracy table)
"""

import numpy as np

from minagent.tasks.shop import classifier
from minagent.tasks.shop import data as shop_data
from minagent.tasks.shop import gate as shop


def accuracy(predicted, requests):
    return sum(p == r.tool for p, r in zip(predicted, requests)) / len(requests)


def test_words():
    assert classifier.words("Refund $240 on A1234!") == ["refund", "<num>", "on", "a", "<num>"]
    assert classifier.words("") == []


def test_separable_toy_data_fit_perfectly():
    texts = ["red apple", "green apple", "yellow banana", "ripe banana", "blue sky", "grey sky"]
    labels = ["fruit", "fruit", "fruit", "fruit", "weather", "weather"]
    model = classifier.fit(texts, labels)
    assert classifier.predict(model, texts) == labels
    assert classifier.predict(model, ["an apple", "the sky", "zzz unknown"])[:2] == ["fruit", "weather"]
    X = classifier.features(model["vocab"], ["apple apple sky", "nothing known"])
    assert X.sum(axis=1).tolist() == [2.0, 0.0]                # presence, not counts; unknown words ignored


def test_deterministic():
    requests = shop_data.train_set(50, seed=1)
    a, b = (classifier.fit([r.text for r in requests], [r.tool for r in requests]) for _ in range(2))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert classifier.random_baseline(requests, seed=3) == classifier.random_baseline(requests, seed=3)


def test_shop_accuracy():
    """Held-out accuracy is printed, not asserted, beyond beating chance: it is a measurement."""
    test, seen = shop_data.test_set(seed=0), shop_data.seen_test_set(150, seed=0)
    print("\nbag-of-words tool accuracy   new phrasings (150)   seen phrasings (150)")
    for n in (50, 500):
        train = shop_data.train_set(n, seed=0)
        model = classifier.fit([r.text for r in train], [r.tool for r in train])
        assert accuracy(classifier.predict(model, [r.text for r in train]), train) == 1.0
        new = accuracy(classifier.predict(model, [r.text for r in test]), test)
        old = accuracy(classifier.predict(model, [r.text for r in seen]), seen)
        print(f"trained on {n:3d}                {new:6.1%}                {old:6.1%}")
        assert new > 0.2 and old >= new


def test_random_baseline_is_one_in_five():
    requests = shop_data.test_set(seed=0)
    scores = [accuracy(classifier.random_baseline(requests, seed), requests) for seed in range(200)]
    assert abs(np.mean(scores) - 1 / len(shop.TOOLS)) < 0.01     # 30,000 draws: standard error 0.0023
    assert set(classifier.random_baseline(requests * 4, seed=0)) == set(shop.TOOLS)
