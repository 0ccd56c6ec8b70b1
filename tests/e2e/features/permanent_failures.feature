Feature: An event we cannot process stops with its reason, and completes once fixed and replayed
  An event of a type we have no handler for, or whose payload lacks what the handler
  needs, cannot succeed by retrying: it ends failed_permanent with a reason, and
  nothing (not Stripe's redelivery, not the recovery sweep) retries it. Once a release
  that handles it is deployed, the operator replays it and it completes, once.

  Scenario Outline: An event that cannot be processed is parked with its reason until a fix is deployed and it is replayed
    Given release 1 of our handlers is deployed
    When Stripe delivers a real <payload>
    Then the event ends failed_permanent with reason "<reason>"
    And its recorded error says "<error>"
    And nothing of it is applied
    When Stripe delivers the same event again
    Then Stripe's delivery is acknowledged as a duplicate
    And no worker is woken for it
    And the recovery sweep does not pick it up
    And the event was attempted only once
    When release 2 of our handlers, which handles it, is deployed
    And the operator replays the event with ledgerctl replay --why "<why>"
    Then the event ends processed
    And the replay is in the event's history with its reason
    And <effect> exactly once

    Examples:
      | payload                                                        | reason             | error                                     | why                                          | effect                                  |
      | charge.refunded payload                                        | unsupported_type   | no handler for event type charge.refunded | release 2 handles charge.refunded            | the refund is recorded                  |
      | checkout.session.completed payload without client_reference_id | unmappable_payload | data.object.client_reference_id           | release 2 provisions checkouts by customer   | a workspace is provisioned for it       |
