// Least-privilege data-plane roles for one principal (the app's identity, or optionally a
// developer). Each role is assigned at the narrowest scope that works:
//   Storage Blob Data Owner          storage account    Functions host: deployment package, timer/host locks
//   Storage Blob Data Contributor    `db-state` container dbfanout state blobs (lease + checkpoint CAS)
//   Storage Queue Data Contributor   storage account    only when useStorageQueues (storage-queue transport)
//   Azure Service Bus Data Sender    each queue         pollers enqueue batches; workers split / DLQ replay
//   Azure Service Bus Data Receiver  each queue         workers receive; the CLI peeks / replays the DLQ
//   Azure Service Bus Data Sender    each topic         topic pollers (rbac-topic.bicep)
//   Azure Service Bus Data Receiver  each subscription  one per handler of a topic poller (rbac-topic.bicep)
//   Monitoring Metrics Publisher     Application Insights telemetry with local auth disabled
//   Key Vault Secrets User           Key Vault          Key Vault references for database URLs
//   Key Vault Secrets Officer        Key Vault          developer only (keyVaultSecretsWriter): sets the URLs
// Never Owner, Contributor or Azure Service Bus Data Owner, and no Service Bus data role on the
// whole namespace (the offline gate rejects them).
// Role ids are the documented built-in role definition GUIDs, written literally so that the
// gate's checks can read them.

@description('Object (principal) id that receives the roles.')
param principalId string

@description('ServicePrincipal for a managed identity; User or Group for a developer.')
@allowed([
  'ServicePrincipal'
  'User'
  'Group'
])
param principalType string = 'ServicePrincipal'

@description('Storage account holding AzureWebJobsStorage, the deployment package and the state container.')
param storageAccountName string

@description('Blob container holding dbfanout state blobs.')
param stateContainerName string

@description('Grant Storage Queue Data Contributor on the account (storage-queue transport).')
param useStorageQueues bool = false

@description('Service Bus namespace holding the poller queues.')
param serviceBusNamespaceName string

@description('Names of the poller queues (one per queue poller).')
param queueNames array

@description('The topics parameter of main.bicep (one per topic poller): {name, subscriptions: [{name, ...}], ...}.')
param topics array = []

@description('Application Insights component that receives telemetry.')
param applicationInsightsName string

@description('Grant Key Vault Secrets User on keyVaultName.')
param grantKeyVault bool = false

@description('Key Vault holding the database URLs (used when grantKeyVault).')
param keyVaultName string = ''

@description('With grantKeyVault: Key Vault Secrets Officer (read and write secrets, for a developer who sets the database URLs) instead of Key Vault Secrets User (read only, for the app).')
param keyVaultSecretsWriter bool = false

var roles = {
  storageBlobDataOwner: 'b7e6dc6d-f1e8-4753-8033-0f276bb0955b'
  storageBlobDataContributor: 'ba92f5b4-2d11-453d-a403-e96b0029c9fe'
  storageQueueDataContributor: '974c5e8b-45b9-4653-ba55-5f855dd0fb88'
  serviceBusDataSender: '69a216fc-b8fb-44d8-bc22-1f3c2cd27a39'
  serviceBusDataReceiver: '4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0'
  monitoringMetricsPublisher: '3913510d-42f4-4e42-8a64-420c390055eb'
  keyVaultSecretsUser: '4633458b-17de-408a-b874-0445c86b69e6'
  keyVaultSecretsOfficer: 'b86a8fe4-44ce-4948-aee5-eccb2c155cd7'
}

resource storage 'Microsoft.Storage/storageAccounts@2023-05-01' existing = {
  name: storageAccountName
}

resource blobService 'Microsoft.Storage/storageAccounts/blobServices@2023-05-01' existing = {
  parent: storage
  name: 'default'
}

resource stateContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' existing = {
  parent: blobService
  name: stateContainerName
}

resource namespace 'Microsoft.ServiceBus/namespaces@2024-01-01' existing = {
  name: serviceBusNamespaceName
}

resource queue 'Microsoft.ServiceBus/namespaces/queues@2024-01-01' existing = [for queueName in queueNames: {
  parent: namespace
  name: queueName
}]

resource appInsights 'Microsoft.Insights/components@2020-02-02' existing = {
  name: applicationInsightsName
}

resource vault 'Microsoft.KeyVault/vaults@2023-07-01' existing = {
  name: keyVaultName
}

resource blobOwnerOnAccount 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  scope: storage
  name: guid(storage.id, principalId, roles.storageBlobDataOwner)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.storageBlobDataOwner)
    principalId: principalId
    principalType: principalType
  }
}

resource blobContributorOnState 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  scope: stateContainer
  name: guid(stateContainer.id, principalId, roles.storageBlobDataContributor)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.storageBlobDataContributor)
    principalId: principalId
    principalType: principalType
  }
}

resource queueContributorOnAccount 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (useStorageQueues) {
  scope: storage
  name: guid(storage.id, principalId, roles.storageQueueDataContributor)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.storageQueueDataContributor)
    principalId: principalId
    principalType: principalType
  }
}

resource senderOnQueue 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for (queueName, i) in queueNames: {
  scope: queue[i]
  name: guid(queue[i].id, principalId, roles.serviceBusDataSender)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.serviceBusDataSender)
    principalId: principalId
    principalType: principalType
  }
}]

resource receiverOnQueue 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for (queueName, i) in queueNames: {
  scope: queue[i]
  name: guid(queue[i].id, principalId, roles.serviceBusDataReceiver)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.serviceBusDataReceiver)
    principalId: principalId
    principalType: principalType
  }
}]

// Sender on each topic, Receiver on each of its subscriptions (a module: resource loops cannot nest).
module topicRoles './rbac-topic.bicep' = [for (t, i) in topics: {
  name: '${deployment().name}-topic-${i}'
  params: {
    principalId: principalId
    principalType: principalType
    serviceBusNamespaceName: namespace.name
    topicName: t.name
    subscriptions: t.subscriptions
  }
}]

resource metricsPublisherOnAppInsights 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  scope: appInsights
  name: guid(appInsights.id, principalId, roles.monitoringMetricsPublisher)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.monitoringMetricsPublisher)
    principalId: principalId
    principalType: principalType
  }
}

resource secretsUserOnVault 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (grantKeyVault && !keyVaultSecretsWriter) {
  scope: vault
  name: guid(vault.id, principalId, roles.keyVaultSecretsUser)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.keyVaultSecretsUser)
    principalId: principalId
    principalType: principalType
  }
}

resource secretsOfficerOnVault 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (grantKeyVault && keyVaultSecretsWriter) {
  scope: vault
  name: guid(vault.id, principalId, roles.keyVaultSecretsOfficer)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.keyVaultSecretsOfficer)
    principalId: principalId
    principalType: principalType
  }
}
