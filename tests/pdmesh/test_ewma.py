from pdmesh.ewma import Ewma


def test_the_first_sample_replaces_the_initial_value_then_each_moves_it_by_alpha():
    average = Ewma(initial=10.0, alpha=0.5)
    assert (average.value, average.num_samples) == (10.0, 0)
    average.observe(2.0)
    assert (average.value, average.num_samples) == (2.0, 1)
    average.observe(4.0)
    assert (average.value, average.num_samples) == (3.0, 2)
