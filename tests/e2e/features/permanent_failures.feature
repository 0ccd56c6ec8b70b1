Feature: An event we cannot process stops with its reason, and completes once fixed and replayed
  An event no handler can take (of a type without a typed handler, whose object has no
  id, so that not even the generic mirror keeps it), or whose payload lacks what the
  handler needs, cannot succeed by retrying: it ends failed_permanent with a reason, and
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
      | invoice.upcoming payload                                       | object_without_id  | data.object has no id                     | release 2 notices upcoming invoices          | the upcoming invoice is noticed         |
      | checkout.session.completed payload without client_reference_id | unmappable_payload | data.object.client_reference_id           | release 2 provisions checkouts by customer   | a workspace is provisioned for it       |
