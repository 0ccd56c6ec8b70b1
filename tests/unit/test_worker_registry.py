"""workers/registry: exact and glob patterns, every matching handler in registration order."""
from __future__ import annotations

from ledger.config import Settings
from workers.registry import HandlerRegistry, load_handlers

WITH_TEST_HANDLERS = Settings(handler_modules=("tests.support.handlers_for_tests",))


def _named(name, calls):
    def fn(ctx):
        calls.append(name)
    fn.__name__ = name
    return fn


def test_an_exact_pattern_matches_only_its_type():
    reg = HandlerRegistry()
    fn = _named("paid", [])
    reg.register("invoice.paid", fn)
    assert reg.resolve("invoice.paid") == [fn]
    assert reg.resolve("invoice.payment_failed") == []
    assert reg.resolve("invoice.paid.extra") == []


def test_a_glob_pattern_matches_every_type_under_it_including_nested_dots():
    reg = HandlerRegistry()
    fn = _named("any_customer", [])
    reg.register("customer.*", fn)
    assert reg.resolve("customer.created") == [fn]
    assert reg.resolve("customer.subscription.updated") == [fn]
    assert reg.resolve("customers.created") == []
    # '.' is literal: invoice.* does not match invoice_payment.paid
    reg.register("invoice.*", fn)
    assert reg.resolve("invoice_payment.paid") == []


def test_matching_is_case_sensitive():
    reg = HandlerRegistry()
    reg.register("invoice.paid", _named("paid", []))
    assert reg.resolve("Invoice.Paid") == []


def test_every_matching_handler_runs_in_registration_order():
    calls: list[str] = []
    reg = HandlerRegistry()
    first, second, third = _named("first", calls), _named("second", calls), _named("third", calls)
    reg.register("invoice.*", first)
    reg.register("invoice.paid", second)
    reg.register("*", third)
    resolved = reg.resolve("invoice.paid")
    assert resolved == [first, second, third]
    for fn in resolved:
        fn(None)
    assert calls == ["first", "second", "third"]
    assert reg.resolve("invoice.created") == [first, third]


def test_a_handler_matching_through_several_patterns_runs_once():
    reg = HandlerRegistry()
    fn = _named("both", [])

    reg.handler("invoice.paid", "invoice.*")(fn)
    assert reg.resolve("invoice.paid") == [fn]
    assert reg.patterns() == ["invoice.paid", "invoice.*"]


def test_registering_the_same_pattern_and_handler_twice_keeps_one_entry():
    reg = HandlerRegistry()
    fn = _named("dup", [])
    reg.register("invoice.paid", fn)
    reg.register("invoice.paid", fn)
    assert reg.patterns() == ["invoice.paid"]


def test_an_unknown_type_has_no_handler():
    reg = HandlerRegistry()
    reg.register("invoice.*", _named("inv", []))
    assert reg.resolve("charge.succeeded") == []
    assert HandlerRegistry().resolve("anything") == []


def test_the_decorator_returns_the_function_unchanged():
    reg = HandlerRegistry()

    @reg.handler("a.b")
    def fn(ctx):
        return "same"
    assert fn(None) == "same"
    assert reg.resolve("a.b") == [fn]


def test_load_handlers_registers_the_billing_handlers_and_configured_modules():
    loaded = load_handlers(WITH_TEST_HANDLERS)
    assert isinstance(loaded, HandlerRegistry)
    from tests.support import handlers_for_tests as t
    from workers.billing import handlers as b

    [mirror] = [fn for fn in loaded.resolve("anything.at.all") if isinstance(fn, b.ObjectMirror)]
    assert loaded.resolve("invoice.paid") == [b.apply_invoice, mirror]
    assert loaded.resolve("customer.subscription.deleted") == [b.apply_subscription, mirror]
    assert loaded.resolve("customer.updated") == [b.apply_customer, mirror]
    assert loaded.resolve("checkout.session.completed") == [b.apply_checkout_session, mirror]
    assert loaded.resolve("entitlements.active_entitlement_summary.updated") == [b.apply_entitlement_summary, mirror]
    # The built-ins come first, the mirror last of them: a user's handler runs after it.
    assert loaded.resolve("test.effect") == [mirror, t.effect]
    # No typed handler: the generic mirror alone (where these used to be unsupported_type).
    for untyped in ("charge.succeeded", "payment_intent.succeeded", "invoice.upcoming", "invoice_payment.paid",
                    "price.created", "product.updated", "plan.created"):
        assert loaded.resolve(untyped) == [mirror], untyped
    assert mirror.registry is loaded


def test_loading_handlers_twice_does_not_register_them_twice():
    before = list(load_handlers(WITH_TEST_HANDLERS).patterns())
    after = load_handlers(WITH_TEST_HANDLERS).patterns()
    assert after == before


# --- v2 event types: only v2 patterns take them -----------------------------------------------

HEALTH = "v2.core.health.event_generation_failure.resolved"


def test_a_v2_event_type_is_matched_only_by_patterns_that_start_with_v2():
    reg = HandlerRegistry()
    everything, v2_any, health = _named("everything", []), _named("v2_any", []), _named("health", [])
    reg.register("*", everything)
    reg.register("v*", _named("v_glob", []))
    reg.register("*.resolved", _named("suffix_glob", []))
    reg.register("v2.*", v2_any)
    reg.register(HEALTH, health)
    # A thin v2 event carries no v1 object: the generic mirror and other wildcards never take it.
    assert reg.resolve(HEALTH) == [v2_any, health]
    assert reg.resolve("v2.core.account.created") == [v2_any]
    # Without a v2 pattern a v2 type has no handler at all (unsupported_type).
    only_wildcards = HandlerRegistry()
    only_wildcards.register("*", everything)
    assert only_wildcards.resolve(HEALTH) == []


def test_wildcards_keep_matching_every_other_type_and_v2_patterns_take_only_v2_types():
    reg = HandlerRegistry()
    everything, v2_any = _named("everything", []), _named("v2_any", [])
    reg.register("*", everything)
    reg.register("v2.*", v2_any)
    for event_type in ("invoice.paid", "v1.customer.subscription.updated", "v2", "v2core.thing", "test.v2.x"):
        assert reg.resolve(event_type) == [everything], event_type


def test_the_generic_mirror_of_the_loaded_registry_takes_no_v2_type():
    from workers.billing import handlers as b

    loaded = load_handlers(WITH_TEST_HANDLERS)
    assert not [fn for fn in loaded.resolve(HEALTH) if isinstance(fn, b.ObjectMirror)]
    assert loaded.resolve("v2.core.account.created") == []


# --- requirements, as modules declare them ----------------------------------------------------

def test_a_modules_declared_requirements_survive_loading():
    from tests.support import handlers_for_tests as t

    loaded = load_handlers(WITH_TEST_HANDLERS)
    [(_, requires)] = [(fn, r) for fn, r in loaded.requirements("test.requires") if fn is t.requires_fields]
    assert requires == ("data.object.id", ("data.object.customer", "data.object.customer_account"))
    assert [e.requires for e in loaded.entries() if e.handler is t.requires_fields] == [requires]


def test_the_built_in_handlers_require_what_their_rows_cannot_do_without():
    from workers.billing import handlers as b, mapping

    loaded = load_handlers(Settings())
    declared = {fn: requires for fn, requires in loaded.requirements("customer.subscription.updated")}
    assert declared == {b.apply_subscription: mapping.SUBSCRIPTION_REQUIRES,
                        next(fn for fn in declared if isinstance(fn, b.ObjectMirror)): ()}
    assert ("data.object.customer", "data.object.customer_account") in mapping.SUBSCRIPTION_REQUIRES
    for event_type, requires in [("customer.updated", mapping.CUSTOMER_REQUIRES),
                                 ("invoice.paid", mapping.INVOICE_REQUIRES),
                                 ("checkout.session.completed", mapping.CHECKOUT_SESSION_REQUIRES),
                                 ("entitlements.active_entitlement_summary.updated",
                                  mapping.ENTITLEMENT_SUMMARY_REQUIRES)]:
        [typed, mirror] = loaded.requirements(event_type)
        assert (typed[1], mirror[1]) == (requires, ()), event_type
    # The mirror states none: it is lenient where other handlers take the type (see ObjectMirror).
    assert loaded.requirements("charge.succeeded")[0][1] == ()
